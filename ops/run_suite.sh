#!/usr/bin/env bash
# The whole suite, as `make test` runs it: in two parts, one pytest command each.
#   1. every test not marked `serial`, on two pytest-xdist workers, a test file to a worker
#      (a file's tests share its server and its module fixtures, so a file stays on one worker);
#   2. the `serial` tests alone on the machine (the Ray replica sets: Ray's own processes, and
#      routing decisions that hang on when each replica answers).
# On 2 cores the whole suite took 10:41 in one process, 6:22 on two workers (the same machine).
# Usage: ops/run_suite.sh PYTEST_COMMAND... -- PYTEST_ARGS...   (WORKERS=n, 0: part 1 in one process)
# pytest exits 5 when it ran no test: a part whose selection is empty is allowed that, but not
# both (a run that tested nothing fails, as a plain pytest run would).
set -uo pipefail
cmd=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do cmd+=("$1"); shift; done
[ $# -gt 0 ] && shift
workers=${WORKERS:-2}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile)
"${cmd[@]}" -q "${parallel[@]}" -m "not serial" "$@"
first=$?
"${cmd[@]}" -q -p no:xdist -m serial "$@"
second=$?
for rc in $first $second; do
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
exit 0
