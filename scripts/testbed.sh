#!/usr/bin/env bash
# Build (and cache) a CPU-only virtualenv holding one REAL SGLang release plus this repo.
#
#   scripts/testbed.sh VERSION          e.g. scripts/testbed.sh 0.5.23
#
# Prints the venv path as the LAST line of stdout; all progress goes to stderr:
#   VENV=$(scripts/testbed.sh 0.5.23 | tail -n1)
#   "$VENV/bin/python" -m pytest tests/component
#
# Layout: ${KVGUARD_TESTBED_ROOT:-$HOME/.cache/kvguard-testbed}/sglang-VERSION
# Cache:  the venv holds a stamp = sha256(this script, VERSION, repo path). If it
#         matches, the path is printed at once; otherwise the venv is removed and rebuilt
#         from scratch (so a half-built venv from a failed run is never reused).
#
# What goes in (nothing CUDA, no torch from the release pins):
#   * torch==$KVGUARD_TORCH_VERSION (default 2.13.0) CPU wheel: from the local wheel
#     directory (pip find-links, --no-index) or the PyTorch CPU index, never the CUDA
#     build from PyPI; afterwards a constraints file pins it so nothing can replace it.
#   * sglang==VERSION with --no-deps.
#   * an allow-list of pure-Python / CPU-safe dependencies. Versions come from the
#     release's own wheel METADATA (Requires-Dist) when it pins them, else from
#     the DEFAULT_PINS / RELEASE_OVERRIDES tables below.
#   * pytest, hypothesis, and this repo with `pip install -e`.
#   * a .pth file putting <repo>/tests/stubs on sys.path (stand-ins for torchvision and
#     sgl_kernel, which have no CPU build on the index; see tests/stubs/*).
#   * Debian's libibverbs1 (Mooncake's transfer engine links it), via apt-get as root.
set -euo pipefail

log() { printf '[testbed] %s\n' "$*" >&2; }
die() { printf '[testbed] ERROR: %s\n' "$*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: $0 SGLANG_VERSION   (e.g. 0.5.23)"
VERSION=$1
[[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+)?$ ]] || die "bad version '$VERSION'"

SCRIPT_PATH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT_PATH")/.." && pwd)
ROOT=${KVGUARD_TESTBED_ROOT:-$HOME/.cache/kvguard-testbed}
VENV=$ROOT/sglang-$VERSION
STAMP_FILE=$VENV/.kvguard-testbed-stamp
TORCH_VERSION=${KVGUARD_TORCH_VERSION:-2.13.0}
PYTHON=${KVGUARD_TESTBED_PYTHON:-python3}

STAMP=$( { cat "$SCRIPT_PATH"; printf '%s\n%s\n%s\n' "$VERSION" "$REPO" "$TORCH_VERSION"; } \
         | sha256sum | cut -d' ' -f1)

# ---------------------------------------------------------------------------------
# Allow-list of dependencies installed into every test bed. Everything SGLang needs to
# import the scheduler / disaggregation / mooncake modules and to RUN prefill, decode
# and router processes in PD mode with mooncake over TCP on CPU. Names are PEP 503
# normalised. A release pin from the wheel METADATA wins over DEFAULT_PINS unless the
# name is in RELEASE_OVERRIDES for that release.
ALLOW=(
  numpy orjson psutil pybase64 requests pillow starlette msgspec packaging pydantic
  pyzmq tqdm ipython aiohttp dill einops setproctitle prometheus-client
  transformers tokenizers sentencepiece compressed-tensors gguf apache-tvm-ffi
  openai openai-harmony partial-json-parser uvicorn fastapi uvloop jsonschema python-multipart
  xgrammar soundfile triton
  mooncake-transfer-engine-non-cuda sglang-router
  pytest hypothesis
)
# Used when the release's METADATA does not pin the package (or does not list it).
DEFAULT_PINS=(
  "triton==3.9.0"                               # torch's CPU wheel pulls no triton
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"   # the CUDA variants need libcuda
  "sglang-router==0.3.2"
)
# Per-release replacements for a METADATA pin ("VERSION|requirement"), for pins that
# are not CPU-safe or do not resolve with torch $TORCH_VERSION. Keep this small.
RELEASE_OVERRIDES=(
)
# Never installed, whatever a release pins (CUDA builds / native kernels).
DENY_RE='^(torch|torchvision|torchaudio|torchao|torchcodec|torch-memory-saver|sgl-kernel|sglang-kernel|flashinfer.*|flash-attn.*|cuda-.*|nvidia-.*|nvshmem.*|sgl-deep-.*|sgl-flash-mla|deep-.*|quack-kernels|humming-kernels|tilelang|tokenspeed-mla|cuda-tile|decord2?|av)$'
# ---------------------------------------------------------------------------------

if [[ -f $STAMP_FILE && "$(cat "$STAMP_FILE")" == "$STAMP" && -x $VENV/bin/python ]]; then
  log "cached: $VENV"
  echo "$VENV"
  exit 0
fi

mkdir -p "$ROOT"
exec 9>"$ROOT/.sglang-$VERSION.lock"
# two concurrent builds of the same release would trample each other
if command -v flock >/dev/null; then flock 9; fi
if [[ -f $STAMP_FILE && "$(cat "$STAMP_FILE")" == "$STAMP" && -x $VENV/bin/python ]]; then
  log "cached (built by a concurrent run): $VENV"
  echo "$VENV"
  exit 0
fi

T0=$SECONDS
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
  || die "cannot run $PYTHON"
# SGLang 0.5.11+ ship cp311-only wheels, and the local CPU torch wheel is cp311.
[[ $PYVER == 3.11 ]] || die "need Python 3.11 (got $PYVER from $PYTHON); set KVGUARD_TESTBED_PYTHON"
log "building SGLang $VERSION test bed in $VENV (repo $REPO)"

# --- system library for mooncake ----------------------------------------------------
# (no `grep -q`: with pipefail, an early grep exit would SIGPIPE ldconfig)
if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true; } \
     | grep 'libibverbs\.so\.1' >/dev/null; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    log "installing Debian libibverbs1 (needed by mooncake-transfer-engine)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >&2
  else
    die "libibverbs.so.1 is missing (Mooncake needs it). Run as root: apt-get update && apt-get install -y libibverbs1"
  fi
fi

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY=$VENV/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONNOUSERSITE=1
pip_() { "$PY" -m pip "$@" >&2; }

# --- torch (CPU) ----------------------------------------------------------------------
log "torch==$TORCH_VERSION (CPU)"
if ! pip_ install -q --no-deps --no-index --only-binary=:all: "torch==$TORCH_VERSION"; then
  log "no local torch wheel; trying the PyTorch CPU index"
  pip_ install -q --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION+cpu" \
    || die "cannot find a CPU wheel for torch $TORCH_VERSION (refusing the CUDA build from PyPI)"
fi
TORCH_EXACT=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
pip_ install -q "torch==$TORCH_EXACT"   # torch's own deps (sympy, networkx, ...)
"$PY" -c 'import torch,sys; sys.exit(torch.version.cuda is not None)' \
  || die "torch $TORCH_EXACT is a CUDA build"

CONSTRAINTS=$VENV/kvguard-constraints.txt
{
  echo "torch==$TORCH_EXACT"
  # Make anything that would drag these in fail to resolve instead of installing CUDA.
  for p in torchvision torchaudio sgl-kernel sglang-kernel flashinfer-python; do echo "$p<0"; done
} > "$CONSTRAINTS"

# --- sglang itself -------------------------------------------------------------------------
WHEELS=$ROOT/wheels
mkdir -p "$WHEELS"
pip_ download -q --no-deps --only-binary=:all: "sglang==$VERSION" -d "$WHEELS"
WHEEL=$(ls "$WHEELS"/sglang-"$VERSION"-*.whl | head -n1)

# --- dependency list from the wheel METADATA + tables ---------------------------------
REQS=$VENV/kvguard-requirements.txt
"$PY" - "$WHEEL" "$VERSION" "$DENY_RE" "${ALLOW[*]}" "${DEFAULT_PINS[*]}" \
      "${RELEASE_OVERRIDES[*]:-}" > "$REQS" <<'PYEOF'
import re, sys, zipfile
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name as norm

wheel, version, deny_re, allow, defaults, overrides = sys.argv[1:7]
allow = [norm(a) for a in allow.split()]
deny = re.compile(deny_re)
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
pins = {}
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # extras and other platforms
    pins[norm(req.name)] = req
default = {norm(Requirement(d).name): d for d in defaults.split()}
override = {}
for item in overrides.split():
    rel, _, spec = item.partition("|")
    if rel == version:
        override[norm(Requirement(spec).name)] = spec
out = []
for name in allow:
    if deny.match(name):
        sys.exit(f"allow-list contains denied package {name}")
    if name in override:
        spec, src = override[name], "override"
    elif name in pins and pins[name].specifier:
        r = pins[name]
        spec, src = f"{r.name}{r.specifier}", "release pin"
    elif name in default:
        spec, src = default[name], "default"
    else:
        spec, src = name, "unpinned"
    print(f"{spec}  # {src}")
PYEOF
log "dependencies (release pins from METADATA, then tables):"
sed 's/^/[testbed]   /' "$REQS" >&2

log "installing dependencies"
pip_ install -q -c "$CONSTRAINTS" -r "$REQS"

log "sglang-kvguard (editable) from $REPO"
pip_ install -q -c "$CONSTRAINTS" -e "$REPO"

# Last, so that pip's dependency check does not list every CUDA package SGLang pins.
log "sglang==$VERSION (--no-deps)"
pip_ install -q --no-deps "$WHEEL"

# --- stand-ins for native packages with no CPU build ----------------------------------
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$REPO/tests/stubs" > "$SITE/kvguard-testbed-stubs.pth"

# Nothing CUDA may have slipped in.
BAD=$("$PY" -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | tr 'A-Z_.' 'a-z--' \
      | grep -E "$DENY_RE" | grep -vx torch || true)
[[ -z $BAD ]] || die "CUDA/native packages were installed: $BAD"

# --- smoke: the modules the tests drive must import, without touching a stand-in -------
log "import check"
CALL_LOG=$(mktemp)
KVGUARD_STUB_CALL_LOG=$CALL_LOG "$PY" - >&2 <<'PYEOF'
import importlib
for m in ("sglang.srt.managers.scheduler", "sglang.srt.disaggregation.prefill",
          "sglang.srt.disaggregation.decode", "sglang.srt.disaggregation.mooncake.conn",
          "sglang.launch_server", "sglang_router", "mooncake.engine"):
    importlib.import_module(m)
import importlib.metadata as md, sglang, torch
# The repo is only checked for being installed: importing it is the tests' business.
kv = md.version("sglang-kvguard")
print(f"[testbed] imports ok: sglang {sglang.__version__}, torch {torch.__version__}, "
      f"sglang-kvguard {kv} (editable)")
PYEOF
if [[ -s $CALL_LOG ]]; then cat "$CALL_LOG" >&2; rm -f "$CALL_LOG"; die "a stand-in was called during import"; fi
rm -f "$CALL_LOG"

echo "$STAMP" > "$STAMP_FILE"
log "done in $((SECONDS - T0)) s: $VENV ($(du -sh "$VENV" | cut -f1))"
echo "$VENV"
