#!/usr/bin/env bash
# NVIDIA's perf_analyzer, without Docker: the `perf-analyzer` package on PyPI
# is an empty placeholder; the real binary ships in the manylinux wheel of
# tritonclient==${PERF_ANALYZER_TRITONCLIENT_VERSION}. It is unpacked apart
# from the runtime venv (that tritonclient is older than ours) and wrapped so
# it finds libb64/libcudart from the server's bundled libraries.
# usage: install_perf_analyzer.sh VENV_PYTHON DEST_DIR TRITON_LIBS_DIR
set -euo pipefail
cd "$(dirname "$0")/.."

venv_python="$1" dest="$2" triton_libs="$(realpath "$3")"
version="${PERF_ANALYZER_TRITONCLIENT_VERSION:?source versions.env first}"

rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib" "$dest/wheel"
"$venv_python" -m pip download --quiet --no-deps --only-binary=:all: \
  --platform manylinux1_x86_64 --dest "$dest/wheel" "tritonclient==$version"
"$venv_python" - "$dest" <<'PY'
import glob, os, sys, zipfile
dest = sys.argv[1]
wheel, = glob.glob(os.path.join(dest, "wheel", "tritonclient-*.whl"))
with zipfile.ZipFile(wheel) as archive:
    member, = [n for n in archive.namelist() if n.endswith("/bin/perf_analyzer")]
    with open(os.path.join(dest, "bin", "perf_analyzer.bin"), "wb") as out:
        out.write(archive.read(member))
os.chmod(os.path.join(dest, "bin", "perf_analyzer.bin"), 0o755)
PY
ln -s "$(ls "$triton_libs"/libb64-*.so.0d)" "$dest/lib/libb64.so.0d"
ln -s "$(ls "$triton_libs"/libcudart-*.so.12*)" "$dest/lib/libcudart.so.12"
rm -rf "$dest/wheel"

cat > "$dest/bin/perf_analyzer" <<WRAP
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$(realpath "$dest/lib"):$triton_libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$(realpath "$dest/bin/perf_analyzer.bin")" "\$@"
WRAP
chmod +x "$dest/bin/perf_analyzer"
"$dest/bin/perf_analyzer" --version
echo "install_perf_analyzer: $dest/bin/perf_analyzer"
