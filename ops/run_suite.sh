#!/usr/bin/env bash
# The whole suite, as `make test` runs it: in two parts, one pytest command each.
#   1. every test not marked `serial`, on two pytest-xdist workers, a test file to a worker
#      (a file's tests share its server and its module fixtures, so a file stays on one worker);
#   2. the `serial` tests alone on the machine: the Ray replica sets (Ray's own processes, and
#      routing decisions that hang on when each replica answers) and the tests that compare
#      timings (a stream's gaps under attack against unloaded; a grammar's cost).
# On 2 cores the whole suite took 10:41 in one process, 7:03 in these two parts (4:15 + 2:48).
# Usage: ops/run_suite.sh PYTEST_COMMAND... -- PYTEST_ARGS...   (WORKERS=n, 0: part 1 in one process)
# pytest exits 5 when it ran no test: a part whose selection is empty is allowed that, but not
# both (a run that tested nothing fails, as a plain pytest run would). A failure in part 1 stops
# the run there. PYTEST_ARGS may not choose markers (-m) or workers (-n): the parts do.
set -uo pipefail
cmd=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do cmd+=("$1"); shift; done
[ $# -gt 0 ] && shift
for arg in "$@"; do
    case $arg in
        -m | -m* | -n | -n* | --numprocesses*)
            echo "ops/run_suite.sh: $arg: the two parts choose their tests by marker and workers themselves;" \
                "run pytest directly to choose by marker (WORKERS=n sets the workers)" >&2
            exit 2
            ;;
    esac
done
workers=${WORKERS:-2}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile)
# (the ${a[@]+...} form: an empty array under set -u on bash 3.2 too)
"${cmd[@]}" -q ${parallel[@]+"${parallel[@]}"} -m "not serial" ${@+"$@"}
first=$?
case $first in 0 | 5) ;; *) exit "$first" ;; esac # a failure (or Ctrl-C) stops the run here
"${cmd[@]}" -q -p no:xdist -m serial ${@+"$@"}
second=$?
case $second in 0 | 5) ;; *) exit "$second" ;; esac
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
exit 0
