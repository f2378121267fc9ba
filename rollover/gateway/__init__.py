"""The gateway: store REST API, recording OpenAI-compatible proxy, pause/drain management.

Nothing is re-exported here: the gateway's clients (`gateway.client`: trainer, controller,
engine, agent env) import it without importing the server (FastAPI, uvicorn); the server is
`gateway.server` (running it) and `gateway.app` (its routes)."""
