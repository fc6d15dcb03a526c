"""What the benchmark drivers share about recording their results."""
import os
import sys


def recorded_command(script):
    """The command line to record with a result: this script's arguments
    without --ferry PATH (a private copy of the binary is not part of it)."""
    args = sys.argv[1:]
    kept = [x for i, x in enumerate(args) if x != "--ferry" and (i == 0 or args[i - 1] != "--ferry")]
    return " ".join(["python3", f"bench/{script}", *kept])


def kept_notes(md_path):
    """The hand-written analysis below a result file's generated part (its
    "## " sections), to be written back after the new tables."""
    if not os.path.exists(md_path):
        return ""
    old = open(md_path).read()
    return old[old.index("\n## "):] if "\n## " in old else ""
