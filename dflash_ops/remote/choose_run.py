"""Run ON THE TARGET: the run a multinode job launches, chosen once in the shared runs dir (runs.choose).
Usage: python3 - '{"runs": DIR, "resume": BOOL}' < (remote.bundle('choose_run.py')); prints NNNN."""

import json
import sys

from dflash_ops.remote import runs


def main():
    args = json.loads(sys.argv[1])
    try:
        print(runs.choose(args["runs"], args["resume"]))
    except OSError as exc:
        print("choose run: %s" % exc, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
