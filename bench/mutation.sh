#!/usr/bin/env bash
# Mutation testing of one module against the fast test files that should catch its faults (mutmut 3, the
# `mutation` extra). Runs in a throwaway copy of the committed tree (HEAD): mutmut rewrites the files it mutates,
# and the working tree (yours, or other people's half-finished edits in it) is neither touched nor read.
#
#   bench/mutation.sh MODULE_FILE TEST_FILE... [-- MUTANT_GLOB...]
#   bench/mutation.sh imba/training/guard.py tests/test_guard_edges.py tests/test_divergence.py
#   bench/mutation.sh data/precomputed.py tests/test_precomputed_reader.py -- 'data.precomputed.xǁ_RecycledMemoryǁ*'
#
# Prints the counts per status (killed, survived, timeout, ...), the score, and the diff of every survivor.
# Environment: JOBS (parallel mutants, default 1), KEEP=1 keeps the copy (its path is printed) for `mutmut show`.
set -euo pipefail

repo=$(git rev-parse --show-toplevel)
[ $# -ge 2 ] || { sed -n 2,11p "$0" | sed 's/^# \{0,1\}//'; exit 2; }
module=$1
shift
tests=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do tests+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
globs=("$@")
mutmut=${MUTMUT:-$repo/.venv/bin/mutmut}
[ -x "$mutmut" ] || { echo "no $mutmut: pip install -e '.[mutation]'" >&2; exit 2; }

copy=$(mktemp -d "${TMPDIR:-/tmp}/imba-mutation.XXXXXX")
[ "${KEEP:-0}" = 1 ] && echo "copy: $copy" || trap 'rm -rf "$copy"' EXIT
git -C "$repo" archive HEAD | tar -x -C "$copy"
{
    echo "[mutmut]"
    # every package is copied into mutants/ (the tests import all three); only MODULE_FILE is mutated
    printf 'source_paths =\n    imba\n    data\n    models\n'
    echo "only_mutate = $module"
    echo "pytest_add_cli_args_test_selection ="
    printf '    %s\n' "${tests[@]}"
    printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -m\n    not slow\n'
    printf 'also_copy =\n    train.py\n    configs\n'
} > "$copy/setup.cfg"

cd "$copy"
# one thread per process: the machine's cores are shared, and forked children must not inherit an OpenMP pool
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
start=$(date +%s)
nice -n 19 "$mutmut" run --max-children "${JOBS:-1}" "${globs[@]}" > mutmut-run.log 2>&1 || {
    tail -40 mutmut-run.log >&2; exit 1; }
seconds=$(( $(date +%s) - start ))
"$mutmut" results --all true 2>/dev/null | grep -v '^$' > results.txt || true
if [ ${#globs[@]} -gt 0 ]; then  # only the mutants asked for
    pattern=$(printf '%s\n' "${globs[@]}" | sed 's/[.]/\\./g; s/\*/.*/g' | paste -sd'|')
    grep -E "^ *($pattern):" results.txt > selected.txt || true
    mv selected.txt results.txt
fi
echo "module $module, tests ${tests[*]}${globs:+, mutants ${globs[*]}}: ${seconds} s"
awk -F': ' '{n[$NF]++; total++} END {for (s in n) printf "  %-12s %d\n", s, n[s]; printf "  %-12s %d\n", "total", total;
    if (total) printf "  killed: %.1f %%\n", 100 * n["killed"] / total}' results.txt
for name in $(awk -F': ' '$NF != "killed" {gsub(/ /, "", $1); print $1}' results.txt); do
    echo "--- $name ($(grep -F "$name:" results.txt | awk -F': ' '{print $NF}'))"
    "$mutmut" show "$name" 2>/dev/null | grep -E '^[-+][^-+]' || true
done
