# Sourced by the call scripts after bench/device_env.sh: the test tools and the tokenizer
# library from .whl/optional where the GPU image lacks them (never shadowing its own).
for mod in pytest:pytest- pytest_timeout:pytest_timeout hypothesis:hypothesis tokenizers:tokenizers \
           yaml:pyyaml; do
  python3 -c "import ${mod%%:*}" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
    --target /tmp/site .whl/optional/${mod#*:}*.whl 2>&1 | tail -1
done
python3 -c "import pluggy, iniconfig" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
  --target /tmp/site .whl/optional/pluggy*.whl .whl/optional/iniconfig*.whl .whl/optional/pygments*.whl \
  .whl/optional/sortedcontainers*.whl 2>&1 | tail -1
