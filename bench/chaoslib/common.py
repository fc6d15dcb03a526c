"""The chaos harness's constants: operations, faults, lab hosts, the VM."""
import os
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ["precopy", "postcopy", "hybrid", "handover", "postcopy-net", "drain", "upgrade"]
MIGRATE_OPS = ("precopy", "postcopy", "hybrid", "postcopy-net")
AGENT_OPS = ("drain", "upgrade")
FAULTS = ["kill", "stop", "cut", "blackhole", "slow", "host"]
HOSTS = {"h1": "ferry-h1", "h2": "ferry-h2", "h3": "ferry-h3"}
ADDR = {"h1": "10.77.0.1", "h2": "10.77.0.2", "h3": "10.77.0.3"}
# The VM: one vCPU always busy (compute, so guest_time moves every tick),
# 64 MiB of data that does not compress, a little dirtying.
MEM = "192M"
WORKLOAD = "compute+fill:content=worst,mib=64+dirty:rate=8,wss=8,pattern=random"
BANDWIDTH = "24M"  # paces the copy so a move lasts a few seconds
# Which processes each fault kind may hit, per operation.
PROC_TARGETS = {
    "precopy": ["src", "dst", "cmd"],
    "postcopy": ["src", "dst", "cmd"],
    "hybrid": ["src", "dst", "cmd"],
    "postcopy-net": ["src", "dst", "cmd", "standby"],
    "handover": ["src", "new", "cmd"],
    "drain": ["src", "dst", "cmd", "a1", "a2"],
    "upgrade": ["src", "new", "cmd", "a1"],
}
HOST_TARGETS = {
    "precopy": ["h1", "h2"], "postcopy": ["h1", "h2"], "hybrid": ["h1", "h2"],
    "postcopy-net": ["h1", "h2", "h3"], "handover": ["h1"],
    "drain": ["h1", "h2", "h3"], "upgrade": ["h1", "h3"],
}
# When faults may land, seconds after the command starts.
WINDOW = {"precopy": 4.0, "postcopy": 4.0, "hybrid": 5.0, "postcopy-net": 5.0, "handover": 0.4,
          "drain": 6.0, "upgrade": 1.0}
GT_FIELD = 43  # /proc/PID/stat: guest_time
OVERLAP_STEPS, OVERLAP_WINDOW = 3, 10
NEAR_SWITCH_S = 0.05
EXEC_SETTLE_S = 0.02
# The registry name of a direct operation's VM (fenced: --vm-name / --fenced,
# through the trial's own embedded registry); an agent's VM is fenced under
# its fleet name (vmK).
FENCE_NAME = "chaos-vm"
HANDED_WAIT_S = 10  # how long the audit lets a source that sent Complete find out it handed the VM


def log(*a):
    print(*a, file=sys.stderr, flush=True)

