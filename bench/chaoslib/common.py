"""The chaos harness's constants: operations, faults, lab hosts, the VM."""
import os
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ["precopy", "postcopy", "hybrid", "handover", "postcopy-net", "drain", "upgrade", "split", "gather"]
# What --ops is by default: the operations before split and gather, so a
# run without --ops draws the schedules it drew before them (and a 42-trial
# batch still fills the 7 x 6 table evenly); --smoke runs all of OPS.
DEFAULT_OPS = OPS[:7]
MIGRATE_OPS = ("precopy", "postcopy", "hybrid", "postcopy-net")
AGENT_OPS = ("drain", "upgrade")
SPLIT_OPS = ("split", "gather")
FAULTS = ["kill", "stop", "cut", "blackhole", "slow", "host"]
# Faults of the registry itself: only with --registry etcd (a real etcd on
# the registry's own lab host), where they join the default --faults.
REGISTRY_FAULTS = ["registry-stop", "registry-kill"]
HOSTS = {"h1": "ferry-h1", "h2": "ferry-h2", "h3": "ferry-h3", "h4": "ferry-h4"}
ADDR = {"h1": "10.77.0.1", "h2": "10.77.0.2", "h3": "10.77.0.3", "h4": "10.77.0.4"}
# --registry etcd: one etcd per trial on its own lab host (ferry-h4),
# plaintext; link faults may hit that host, a host's death may not (the
# registry's death is registry-kill, which restarts it on its data dir).
REGISTRY_HOST = "h4"
ETCD_PORT = 2379
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
    # mem: a memory server (mem0, on ferry-h3). In gather, src is the split
    # VM's main host (on ferry-h2) and dst the gathering VMM (on ferry-h1).
    "split": ["src", "dst", "cmd", "mem"],
    "gather": ["src", "dst", "cmd", "mem"],
}
HOST_TARGETS = {
    "precopy": ["h1", "h2"], "postcopy": ["h1", "h2"], "hybrid": ["h1", "h2"],
    "postcopy-net": ["h1", "h2", "h3"], "handover": ["h1"],
    "drain": ["h1", "h2", "h3"], "upgrade": ["h1", "h3"],
    "split": ["h1", "h2", "h3"], "gather": ["h1", "h2", "h3"],
}
# When faults may land, seconds after the command starts.
WINDOW = {"precopy": 4.0, "postcopy": 4.0, "hybrid": 5.0, "postcopy-net": 5.0, "handover": 0.4,
          "drain": 6.0, "upgrade": 1.0, "split": 4.0, "gather": 5.0}
# A split VM: the main host holds MAIN_BUDGET of its memory (less than the
# 64 MiB the fill writes, so the servers hold data), two memory
# servers on ferry-h3 the rest (half the trials each chunk on both:
# --replicas 2).
MAIN_BUDGET = "48M"
# A split VM's guest writes all over 64 MiB (more than its main host holds),
# so it keeps paging from the servers after the switch: a server that dies
# or stalls then is felt at once.
SPLIT_WORKLOAD = "compute+fill:content=worst,mib=64+dirty:rate=8,wss=64,pattern=random"
MEM_PORTS = (7501, 7502)
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

