#!/bin/sh
# Find the interpreter that holds the base image's torch and make it `python` on PATH.
#
#   sh find_python.sh DIR CANDIDATE...
#
# The torch_musa release images keep torch in a conda env (/opt/conda/envs/py3X) that
# only root's interactive shell activates; RUN steps, exec-form ENTRYPOINT/HEALTHCHECK
# and a non-root user never see it. This writes DIR/bin/python and DIR/bin/python3
# (small scripts that exec the interpreter found) and links DIR/prefix to its prefix;
# the Dockerfile puts DIR/bin and DIR/prefix/bin first on PATH for every later step and
# user. A candidate is a path (unmatched globs are skipped) or a command name on PATH.
# The check asks for torch's import spec only: importing torch here would autoload
# torch_musa, which needs driver libraries that no build step has.
set -eu
dir=$1
shift
tried=""
for candidate in "$@"; do
    case "$candidate" in
        */*) path=$candidate ;;
        *) path=$(command -v "$candidate" 2>/dev/null || true) ;;
    esac
    if [ -z "$path" ] || [ ! -x "$path" ]; then
        continue
    fi
    tried="$tried $path"
    # An answer, not an exit code: anything executable exits 0 for `-c ...`.
    found=$("$path" -c 'import importlib.util; print(importlib.util.find_spec("torch") is not None)' 2>/dev/null || true)
    if [ "$found" = "True" ]; then
        mkdir -p "$dir/bin"
        for name in python python3; do
            printf '#!/bin/sh\nexec "%s" "$@"\n' "$path" > "$dir/bin/$name"
            chmod 755 "$dir/bin/$name"
        done
        ln -sfn "$("$path" -c 'import sys; print(sys.prefix)')" "$dir/prefix"
        echo "vendor python: $path ($("$path" --version 2>&1)), prefix $(readlink "$dir/prefix")"
        exit 0
    fi
done
echo "error: no Python interpreter in this base image has torch (tried:${tried:- nothing}). Pick a torch_musa release image as BASE_IMAGE, or name the interpreter with --build-arg PYTHON=/path/to/python." >&2
exit 1
