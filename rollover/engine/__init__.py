"""The inference engine: vLLM's OpenAI server owned by Rollover (`vllm_engine`), the process
that supervises it (`supervisor`), weight sync into it (`weights`, `weight_sync`) and the
watchdog that restarts it (`watchdog`). Nothing is imported here, so that the supervisor
starts without loading the rest."""
