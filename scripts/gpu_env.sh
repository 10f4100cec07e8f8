# Sourced at the top of a command on the lent GPU machine (bash): installs what its image
# lacks from the carried, git-ignored .whl/ folder, and sets FlashInfer up.
#   .whl/*.whl                  wheels for Python 3.12 (pyzmq, apache-tvm-ffi)
#   .whl/flashinfer_slim.tgz    flashinfer-python 0.7.2.post1 with the sources of kernels we
#                               never build removed (MoE, MLA, sampling, ...): the whole wheel
#                               plus tvm-ffi is 63 MB of the 64 MiB a call may carry
#   .whl/fi_aot.tgz.part*       FlashInfer modules compiled by an earlier call (its $OUT),
#                               installed as AOT modules so they are not rebuilt (~110 s)
# After a run, `fi_save_jit "$OUT"` packs the modules built this time for the next call.
export PYTHONUNBUFFERED=1
SITE=/tmp/site
if [ ! -d "$SITE/flashinfer" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl 2>&1 | tail -2
  [ -f .whl/flashinfer_slim.tgz ] && tar xzf .whl/flashinfer_slim.tgz -C "$SITE"
  if ls .whl/fi_aot.tgz.part* >/dev/null 2>&1; then
    mkdir -p "$SITE/flashinfer/data/aot" && cat .whl/fi_aot.tgz.part* | tar xzf - -C "$SITE/flashinfer/data/aot"
    echo "flashinfer AOT modules: $(ls "$SITE/flashinfer/data/aot" | tr '\n' ' ')"
  fi
fi
export PYTHONPATH=$SITE:$PWD
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws

fi_save_jit() {  # $1: output folder
  local dir=/tmp/fiws/fi_aot
  rm -rf "$dir" && mkdir -p "$dir"
  find /tmp/fiws -path '*cached_ops*' -name '*.so' | while read -r so; do
    name=$(basename "$so" .so); mkdir -p "$dir/$name" && cp "$so" "$dir/$name/"
  done
  if [ -n "$(ls "$dir")" ]; then
    tar czf - -C "$dir" . | split -b 15m - "$1/fi_aot.tgz.part"
    echo "saved JIT modules: $(ls "$dir" | tr '\n' ' ') -> $(du -ch "$1"/fi_aot.tgz.part* | tail -1)"
  fi
}
