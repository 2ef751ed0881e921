#!/usr/bin/env bash
# Install the peers that tools/bench_peers.py measures hfexport against, each in a virtual environment of its own
# (they are never dependencies of hfexport, and their pins conflict with each other and with ours):
#
#   onnxruntime-genai    onnxruntime-genai 0.18 (its model builder and Generator), on the CPU torch
#   optimum-intel        optimum-intel 2.2 (OVModelForCausalLM, stateful), transformers < 5.6 as it requires
#   optimum-executorch   optimum-executorch 1.1 (custom SDPA + KV cache, XNNPACK), executorch 1.4.1, transformers 5.0.0rc1
#
#   tools/peers/setup.sh [--dir DIR] [--python PYTHON] [--torch-index URL] [--force] [PEER ...]
#
# DIR defaults to $HFEXPORT_PEERS or ~/.cache/hfexport-peers; each peer goes to DIR/<peer> (all three by default).
# torch is installed first, alone, as the CPU build (torch==2.13.0: a local CPU wheel where pip's find-links has
# one, else pass --torch-index https://download.pytorch.org/whl/cpu); the peer is then installed with a constraint
# file pinning that torch, so pip never replaces it with a CUDA build, and the script fails if any nvidia-* or
# triton package is in the environment afterwards. DIR/<peer>/freeze.txt records what was installed.
set -euo pipefail

DIR="${HFEXPORT_PEERS:-$HOME/.cache/hfexport-peers}"
PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"
TORCH_INDEX=""
FORCE=0
PEERS=()
ALL=(onnxruntime-genai optimum-intel optimum-executorch)

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dir) DIR="$2"; shift 2 ;;
        --python) PYTHON="$2"; shift 2 ;;
        --torch-index) TORCH_INDEX="$2"; shift 2 ;;
        --force) FORCE=1; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "unknown option $1" >&2; usage >&2; exit 2 ;;
        *) PEERS+=("$1"); shift ;;
    esac
done
[[ ${#PEERS[@]} -gt 0 ]] || PEERS=("${ALL[@]}")

# Each peer's packages and the pins beside torch's (one requirement a line).
peer_packages() {
    case "$1" in
        onnxruntime-genai) echo "onnxruntime-genai==0.18.0 transformers onnx onnx-ir onnxscript" ;;
        optimum-intel) echo "optimum-intel==2.2.0" ;;
        optimum-executorch) echo "optimum-executorch==1.1.0" ;;
        *) return 1 ;;
    esac
}
peer_pins() {
    case "$1" in
        optimum-intel) printf '%s\n' "transformers<5.6" ;;
        optimum-executorch) printf '%s\n' "executorch==1.4.1" "transformers==5.0.0rc1" ;;
    esac
}

install_peer() {
    local peer="$1" venv="$DIR/$1"
    local packages
    packages="$(peer_packages "$peer")" || { echo "unknown peer $peer (one of ${ALL[*]})" >&2; return 2; }
    if [[ -f "$venv/freeze.txt" && $FORCE -eq 0 ]]; then
        echo "$peer: already installed in $venv (--force to reinstall)"
        return 0
    fi
    echo "$peer: creating $venv"
    "$PYTHON" -m venv --clear "$venv"
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
    { echo "$TORCH"; peer_pins "$peer"; } >"$venv/constraints.txt"
    local index=()
    [[ -z "$TORCH_INDEX" ]] || index=(--index-url "$TORCH_INDEX")
    "${pip[@]}" install "${index[@]}" "$TORCH"
    # shellcheck disable=SC2086  # the package list is split on purpose
    "${pip[@]}" install -c "$venv/constraints.txt" $packages
    if [[ "$peer" == optimum-intel ]]; then
        # optimum-intel requires torchvision, which pulls a torch of its own pin and is not used for text models.
        "${pip[@]}" uninstall -y torchvision
    fi
    if "${pip[@]}" list --format=freeze | grep -i -E '^(nvidia-|triton)'; then
        echo "$peer: a CUDA package reached $venv (listed above); remove it or reinstall with --torch-index" >&2
        return 1
    fi
    "$venv/bin/python" -c "import torch; assert not torch.version.cuda, torch.__version__; print('torch', torch.__version__)"
    "${pip[@]}" list --format=freeze >"$venv/freeze.txt"
    echo "$peer: done ($(du -sh "$venv" | cut -f1))"
}

mkdir -p "$DIR"
status=0
for peer in "${PEERS[@]}"; do
    install_peer "$peer" || { echo "$peer: FAILED" >&2; status=1; }
done
exit $status
