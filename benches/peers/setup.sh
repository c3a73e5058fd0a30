#!/usr/bin/env bash
# Creates the peers' virtualenv (DyNet 2.2 through the `dynet38` wheel, and PyTorch from PyPI) under
# target/peers-venv.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv="$root/target/peers-venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check dynet38 numpy torch
"$venv/bin/python" -c 'import dynet_config; dynet_config.set(autobatch=1); import dynet; print("dynet", getattr(dynet, "__version__", "2.2"), "ready")'
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__, "ready")'
