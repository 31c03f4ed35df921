"""byteps_like.topology: discovery over fake sysfs trees, and the pure placement function."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from byteps_like import config as C
from byteps_like import topology as T
from byteps_like.errors import ConfigError
from byteps_like.topology import (
    CpuListError,
    Gpu,
    NumaNode,
    Topology,
    discover,
    format_cpu_list,
    normalize_bus_id,
    parse_cpu_list,
    place,
)


# ------------------------------------------------------------------------------ a fake sysfs
class FakeSys:
    """Builds the parts of a sysfs tree that discover() reads, under ``root``."""

    def __init__(self, root: Path):
        self.root = root
        (root / "devices" / "system" / "cpu").mkdir(parents=True)
        (root / "bus" / "pci" / "devices").mkdir(parents=True)
        (root / "class" / "net").mkdir(parents=True)

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def cpus(self, online: str, siblings: dict[int, str] | None = None) -> FakeSys:
        self.write("devices/system/cpu/online", online)
        for cpu in parse_cpu_list(online):
            (self.root / f"devices/system/cpu/cpu{cpu}").mkdir(exist_ok=True)
        for cpu, text in (siblings or {}).items():
            self.write(f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", text)
        return self

    def hyperthreads(self, cores: int, threads: int = 2) -> FakeSys:
        """Linux's usual numbering: CPU c and c + cores * k are siblings."""
        n = cores * threads
        siblings = {c: ",".join(str(c % cores + cores * k) for k in range(threads))
                    for c in range(n)}
        return self.cpus(f"0-{n - 1}", siblings)

    def node(self, node_id: int, cpulist: str) -> FakeSys:
        self.write(f"devices/system/node/node{node_id}/cpulist", cpulist)
        return self

    def pci(self, path: str, vendor: int = 0x10DE, klass: int = 0x030200,
            numa_node: int | None = 0) -> str:
        """A PCI device at ``devices/<path>`` (``pci0000:00/0000:00:01.0/...``) and its
        ``bus/pci/devices`` link; the bridges on the way get their links too."""
        parts = path.split("/")
        for depth in range(2, len(parts) + 1):
            bdf = parts[depth - 1]
            link = self.root / "bus" / "pci" / "devices" / bdf
            target = Path("../../../devices", *parts[:depth])
            (self.root / "devices" / target.relative_to("../../../devices")).mkdir(
                parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(target)
        device = self.root / "devices" / path
        (device / "vendor").write_text(f"0x{vendor:04x}\n")
        (device / "class").write_text(f"0x{klass:06x}\n")
        (device / "numa_node").write_text(f"{-1 if numa_node is None else numa_node}\n")
        return parts[-1]

    def nic(self, name: str, device_path: str | None) -> None:
        """``class/net/<name>``, with ``device`` pointing into ``devices/<device_path>``."""
        folder = self.root / "class" / "net" / name
        folder.mkdir()
        if device_path is not None:
            (self.root / "devices" / device_path).mkdir(parents=True, exist_ok=True)
            (folder / "device").symlink_to(Path("../../../devices", device_path))


def bridge(sysfs: FakeSys, path: str) -> None:
    sysfs.pci(path, vendor=0x8086, klass=0x060400, numa_node=None)


def dgx_like(sysfs: FakeSys, switches: int) -> list[str]:
    """8 GPUs on two sockets behind ``switches`` PCIe switches (2 or 4), plus an NVIDIA audio
    function, an NVSwitch-like bridge and a BMC VGA that are not GPUs. Returns GPU paths."""
    sysfs.hyperthreads(cores=16).node(0, "0-7,16-23").node(1, "8-15,24-31")
    paths = []
    per_switch = 8 // switches
    for s in range(switches):
        socket = s * 2 // switches
        rc = "00" if socket == 0 else "80"
        root_port = f"pci0000:{rc}/0000:{rc}:{1 + s:02x}.0"
        bus = int(rc, 16) + 0x10 * (s % (switches // 2)) + 1
        up = f"{root_port}/0000:{bus:02x}:00.0"
        bridge(sysfs, up)
        for g in range(per_switch):
            down = f"{up}/0000:{bus + 1:02x}:{8 + g:02x}.0"
            gpu = f"{down}/0000:{bus + 2 + g:02x}:00.0"
            sysfs.pci(gpu, numa_node=socket)
            paths.append(gpu)
    sysfs.pci(paths[0][:-1] + "1", klass=0x040300, numa_node=0)           # GPU 0's audio
    sysfs.pci("pci0000:00/0000:00:1f.0/0000:7f:00.0", klass=0x068000)     # NVSwitch-like
    sysfs.pci("pci0000:00/0000:00:1e.0/0000:7e:00.0", vendor=0x1A03, klass=0x030000)  # BMC
    return paths


@pytest.fixture
def sysfs(tmp_path) -> FakeSys:
    return FakeSys(tmp_path / "sys")


# ------------------------------------------------------------------------------ CPU lists
@pytest.mark.parametrize("text,cpus", [
    ("", ()), ("  ", ()), ("0", (0,)), ("0-3", (0, 1, 2, 3)),
    ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
    (" 3 , 1-2 ", (1, 2, 3)), ("5,5,4-5", (4, 5)), ("7-7", (7,)),
])
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text,reason", [
    ("0-x", "'0-x' is not N or N-M"), ("a", "not N or N-M"), ("1,,2", "empty item"),
    ("3-1", "runs backwards"), ("-1", "not N or N-M"), ("0-99999", "beyond"), ("1 2", "not N"),
])
def test_parse_cpu_list_errors(text, reason):
    with pytest.raises(CpuListError, match=reason) as info:
        parse_cpu_list(text)
    assert isinstance(info.value, ValueError) and repr(text) in str(info.value)


@pytest.mark.parametrize("cpus,text", [((), ""), ((0,), "0"), ((0, 1, 2, 3, 8, 10, 11),
                                       "0-3,8,10-11"), ([5, 3, 4, 3], "3-5"), ((0, 2, 4), "0,2,4")])
def test_format_cpu_list_round_trips(cpus, text):
    assert format_cpu_list(cpus) == text
    assert parse_cpu_list(text) == tuple(sorted(set(cpus)))


@pytest.mark.parametrize("text,bus_id", [
    ("0000:3b:00.0", "0000:3b:00.0"), ("00000000:3B:00.0", "0000:3b:00.0"),
    ("3b:00.0", "0000:3b:00.0"), ("0001:0a:1f.7", "0001:0a:1f.7"),
    (" 0000:3B:00.0 ", "0000:3b:00.0"),
])
def test_normalize_bus_id(text, bus_id):
    assert normalize_bus_id(text) == bus_id


def test_bus_id_errors_and_parts():
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalize_bus_id("GPU-0f1e")
    assert T.format_bus_id(0, 0x3B, 0) == "0000:3b:00.0"


# ------------------------------------------------------------------------------ discovery
def test_one_numa_node(sysfs):
    sysfs.cpus("0-3").node(0, "0-3")
    topo = discover(sysfs.root)
    assert topo.cpus == (0, 1, 2, 3) and topo.numa_known
    assert topo.numa_nodes == (NumaNode(0, (0, 1, 2, 3)),)
    assert topo.cores == ((0,), (1,), (2,), (3,))  # no sibling lists: each CPU a core
    assert topo.gpus == () and topo.nics == ()
    p = place(topo, local_size=2)
    assert [r.cpus for r in p.ranks] == [(0, 1), (2, 3)]
    assert [(r.numa_node, r.buffer_node, r.memory_node, r.gpus) for r in p.ranks] == [
        (0, 0, 0, ())] * 2
    assert p.server_cpus == () and p.numa_on and p.notes == ()


def test_two_numa_nodes_cpu_ranks_round_robin(sysfs):
    sysfs.cpus("0-7").node(0, "0-3").node(1, "4-7")
    topo = discover(sysfs.root)
    assert [n.cpus for n in topo.numa_nodes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert topo.node_of(5) == 1 and topo.node_of(99) is None
    p = place(topo, local_size=4)
    assert [r.numa_node for r in p.ranks] == [0, 1, 0, 1]
    assert [r.cpus for r in p.ranks] == [(0, 1), (4, 5), (2, 3), (6, 7)]
    assert [r.describe() for r in p.ranks[:2]] == ["CPUs 0-1, NUMA node 0",
                                                   "CPUs 4-5, NUMA node 1"]
    # three ranks: two on node 0, one alone on node 1
    assert [r.cpus for r in place(topo, local_size=3).ranks] == [(0, 1), (4, 5, 6, 7), (2, 3)]


def test_hyperthreads_stay_together(sysfs):
    sysfs.hyperthreads(cores=8).node(0, "0-3,8-11").node(1, "4-7,12-15")
    topo = discover(sysfs.root)
    assert topo.cores[:2] == ((0, 8), (1, 9)) and len(topo.cores) == 8
    assert topo.siblings_of(9) == (1, 9)
    assert [r.cpus for r in place(topo, local_size=2).ranks] == [
        (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)]
    assert [r.cpus for r in place(topo, local_size=4).ranks] == [
        (0, 1, 8, 9), (4, 5, 12, 13), (2, 3, 10, 11), (6, 7, 14, 15)]
    eight = place(topo, local_size=8)
    assert all(len(r.cpus) == 2 and topo.siblings_of(r.cpus[0]) == r.cpus for r in eight.ranks)
    # more ranks than cores on a node: the siblings are split, one CPU each
    sixteen = place(topo, local_size=16)
    assert sorted(c for r in sixteen.ranks for c in r.cpus) == list(range(16))
    assert [r.cpus for r in sixteen.ranks[:4]] == [(0,), (4,), (8,), (12,)]


def test_core_cpus_list_is_the_fallback_sibling_file(sysfs):
    sysfs.cpus("0-3").node(0, "0-3")
    for cpu, sib in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        sysfs.write(f"devices/system/cpu/cpu{cpu}/topology/core_cpus_list", sib)
    assert discover(sysfs.root).cores == ((0, 2), (1, 3))


@pytest.mark.parametrize("switches,groups", [
    (2, ((0, 1, 2, 3), (4, 5, 6, 7))),
    (4, ((0, 1), (2, 3), (4, 5), (6, 7))),
])
def test_eight_gpus_behind_pcie_switches(sysfs, switches, groups):
    paths = dgx_like(sysfs, switches)
    topo = discover(sysfs.root)
    assert len(topo.gpus) == 8, topo.gpus  # not the audio function, NVSwitch bridge or BMC
    assert [g.index for g in topo.gpus] == list(range(8))
    assert [g.bus_id for g in topo.gpus] == sorted(p.rsplit("/", 1)[1] for p in paths)
    assert [g.numa_node for g in topo.gpus] == [0] * 4 + [1] * 4
    assert topo.switch_groups() == groups
    g0 = topo.gpus[0]
    assert g0.pci_path == tuple(paths[0].split("/")[1:]) and g0.switch == g0.pci_path[1]
    p = place(topo, local_size=8)
    assert [r.gpu for r in p.ranks] == list(range(8))
    assert [r.numa_node for r in p.ranks] == [0] * 4 + [1] * 4
    assert [r.buffer_node for r in p.ranks] == [0] * 4 + [1] * 4
    # node 0 has 8 cores (0-7 with siblings 16-23) for 4 ranks: two cores each
    assert p[0].cpus == (0, 1, 16, 17) and p[3].cpus == (6, 7, 22, 23)
    assert p[4].cpus == (8, 9, 24, 25)
    assert "GPU 0: 0000:" in topo.describe() and "switch 0000:" in topo.describe()


def test_gpu_bus_ids_give_cuda_order(sysfs):
    dgx_like(sysfs, 2)
    pci_order = [g.bus_id for g in discover(sysfs.root).gpus]
    smi = ["0000" + b.upper() for b in reversed(pci_order)]  # nvidia-smi: 8-digit domain
    topo = discover(sysfs.root, gpu_bus_ids=smi)
    assert [g.bus_id for g in topo.gpus] == pci_order[::-1]
    assert [g.index for g in topo.gpus] == list(range(8))
    assert [g.numa_node for g in topo.gpus] == [1] * 4 + [0] * 4
    assert [r.numa_node for r in place(topo, local_size=8).ranks] == [1] * 4 + [0] * 4
    # only the GPUs CUDA sees; one sysfs does not know keeps an unknown position
    two = discover(sysfs.root, gpu_bus_ids=[pci_order[5], "0000:ee:00.0"])
    assert two.gpus[0] == Gpu(0, pci_order[5], 1, two.gpus[0].switch, two.gpus[0].pci_path)
    assert two.gpus[1] == Gpu(1, "0000:ee:00.0")
    with pytest.raises(ValueError, match="more than once"):
        discover(sysfs.root, gpu_bus_ids=[pci_order[0], pci_order[0].upper()])


def test_cuda_visible_devices_selects_and_renumbers(sysfs):
    dgx_like(sysfs, 2)
    topo = discover(sysfs.root)
    seen, note = T.cuda_visible(topo, "4, 5,0")
    assert note is None
    assert [(g.index, g.bus_id) for g in seen.gpus] == [
        (0, topo.gpus[4].bus_id), (1, topo.gpus[5].bus_id), (2, topo.gpus[0].bus_id)]
    assert seen.cpus == topo.cpus and seen.numa_nodes == topo.numa_nodes
    assert [r.numa_node for r in place(seen, local_size=3).ranks] == [1, 1, 0]
    # CUDA stops at the first invalid entry; an empty list or -1 hides every GPU
    assert len(T.cuda_visible(topo, "1,9,2")[0].gpus) == 1
    assert len(T.cuda_visible(topo, "1,1")[0].gpus) == 1
    assert T.cuda_visible(topo, "")[0].gpus == T.cuda_visible(topo, "-1")[0].gpus == ()
    hidden, note = T.cuda_visible(topo, "GPU-8c1e0b6a-1b2c-4d5e-8f90-123456789abc")
    assert hidden.gpus == () and "names GPUs by UUID" in note


def test_gpu_without_numa_node_and_without_switch(sysfs):
    # a cloud VM: GPUs straight on the root bus, numa_node -1, two NUMA nodes
    sysfs.cpus("0-7").node(0, "0-3").node(1, "4-7")
    sysfs.pci("pci0000:00/0000:00:05.0", numa_node=None)
    sysfs.pci("pci0000:00/0000:00:01.0/0000:01:00.0", numa_node=1)  # below a root port
    topo = discover(sysfs.root)
    assert [(g.bus_id, g.numa_node, g.switch) for g in topo.gpus] == [
        ("0000:00:05.0", None, None), ("0000:01:00.0", 1, None)]
    assert topo.switch_groups() == ((0,), (1,))
    p = place(topo, local_size=2)
    # rank 0's GPU node is unknown: round-robin gives node 0; rank 1 follows its GPU to node 1
    assert [(r.numa_node, r.buffer_node) for r in p.ranks] == [(0, 0), (1, 1)]


def test_nics(sysfs):
    sysfs.cpus("0-3").node(0, "0-1").node(1, "2-3")
    sysfs.pci("pci0000:80/0000:80:02.0/0000:81:00.0", vendor=0x15B3, klass=0x020700,
              numa_node=1)
    sysfs.nic("ib0", "pci0000:80/0000:80:02.0/0000:81:00.0")
    sysfs.pci("pci0000:00/0000:00:03.0", vendor=0x1AF4, klass=0x020000, numa_node=None)
    sysfs.nic("eth0", "pci0000:00/0000:00:03.0/virtio2")  # virtio: one level below the PCI fn
    sysfs.nic("lo", None)
    sysfs.nic("docker0", None)
    topo = discover(sysfs.root)
    assert [(n.name, n.bus_id, n.numa_node) for n in topo.nics] == [
        ("eth0", "0000:00:03.0", None), ("ib0", "0000:81:00.0", 1)]
    assert topo.gpus == ()  # a Mellanox NIC is not a GPU
    assert "NIC ib0: 0000:81:00.0, NUMA node 1" in topo.describe()


def test_nic_behind_the_gpus_switch(sysfs):
    paths = dgx_like(sysfs, 4)
    up = "/".join(paths[0].split("/")[:3])
    nic = f"{up}/0000:02:1f.0/0000:1e:00.0"
    sysfs.pci(nic, vendor=0x15B3, klass=0x020000, numa_node=0)
    sysfs.nic("ens1", nic)
    topo = discover(sysfs.root)
    assert topo.nics[0].switch == topo.gpus[0].switch == topo.gpus[1].switch
    assert topo.nics[0].switch != topo.gpus[2].switch


def test_missing_files_degrade(sysfs, tmp_path):
    # nothing at all: every CPU the OS reports, one assumed node
    empty = discover(tmp_path / "nothing")
    assert empty.cpus == tuple(range(os.cpu_count() or 1)) and not empty.numa_known
    assert empty.numa_nodes == (NumaNode(0, empty.cpus),) and empty.gpus == empty.nics == ()
    # cpu/online missing: the cpuN folders count; no node folder: one node with every CPU
    for cpu in range(3):
        (sysfs.root / f"devices/system/cpu/cpu{cpu}").mkdir()
    topo = discover(sysfs.root)
    assert topo.cpus == (0, 1, 2) and topo.numa_nodes == (NumaNode(0, (0, 1, 2)),)
    assert not topo.numa_known and "assumed" in topo.describe()
    # a node without a readable cpulist, an online CPU in no node, junk in numa_node
    sysfs.write("devices/system/cpu/online", "0-3")
    (sysfs.root / "devices/system/node/node0").mkdir(parents=True)
    sysfs.node(1, "0-1")
    gpu = sysfs.pci("pci0000:00/0000:00:04.0")
    (sysfs.root / "bus/pci/devices" / gpu / "numa_node").write_text("garbage\n")
    topo = discover(sysfs.root)
    assert topo.numa_known
    assert topo.numa_nodes == (NumaNode(0, ()), NumaNode(1, (0, 1, 2, 3)))
    assert topo.gpus[0].numa_node is None
    assert [r.numa_node for r in place(topo, local_size=2).ranks] == [1, 1]


def test_memoryless_node_gets_no_membind(sysfs):
    sysfs.cpus("0-3").node(0, "0-1").node(1, "2-3")
    sysfs.write("devices/system/node/has_memory", "0")
    topo = discover(sysfs.root)
    assert [n.has_memory for n in topo.numa_nodes] == [True, False]
    p = place(topo, local_size=2)
    assert [(r.numa_node, r.memory_node) for r in p.ranks] == [(0, 0), (1, None)]
    assert "no memory" in topo.describe()


# ------------------------------------------------------------------------------ placement
def two_nodes(cores_per_node: int = 4, threads: int = 1, gpus: tuple[Gpu, ...] = ()) -> Topology:
    n = cores_per_node * 2
    cores = tuple(tuple(c + n * k for k in range(threads)) for c in range(n))
    node0 = tuple(sorted(c for core in cores[:cores_per_node] for c in core))
    node1 = tuple(sorted(c for core in cores[cores_per_node:] for c in core))
    return Topology(tuple(range(n * threads)), (NumaNode(0, node0), NumaNode(1, node1)), cores,
                    gpus)


def test_blacklist_and_visible_cpus():
    topo = two_nodes()
    p = place(topo, local_size=2, blacklist=[0, 4])
    assert [r.cpus for r in p.ranks] == [(1, 2, 3), (5, 6, 7)]
    p = place(topo, local_size=2, visible_cpus=range(0, 6))
    assert [r.cpus for r in p.ranks] == [(0, 1, 2, 3), (4, 5)]
    # visible only on node 0: both ranks there
    p = place(topo, local_size=2, visible_cpus={0, 1, 2, 3, 99}, blacklist=(3,))
    assert [(r.cpus, r.numa_node) for r in p.ranks] == [((0, 1), 0), ((2,), 0)]
    with pytest.raises(ValueError, match="no usable CPU: online 0-7, visible 8, "
                                         "blacklisted none"):
        place(topo, local_size=1, visible_cpus=[8])
    with pytest.raises(ValueError, match="no usable CPU"):
        place(topo, local_size=1, blacklist=range(8))


def test_numa_off_gives_every_rank_every_usable_cpu():
    gpus = tuple(Gpu(i, f"0000:0{i}:00.0", i % 2) for i in range(2))
    p = place(two_nodes(gpus=gpus), local_size=3, numa_on=False, blacklist=[7],
              server_engine_threads=2)
    assert not p.numa_on
    assert all(r.cpus == (0, 1, 2, 3, 4, 5, 6) and r.numa_node is None
               and r.buffer_node is None and r.memory_node is None for r in p.ranks)
    assert p.server_cpus == (0, 1, 2, 3, 4, 5, 6)
    assert p[0].describe() == "CPUs 0-6, no NUMA preference"
    assert [r.gpus for r in p.ranks] == [(), (), ()]  # 2 GPUs for 3 ranks: none used
    # more ranks than CPUs is no problem when nothing is split
    assert len(place(Topology.flat(2), local_size=5, numa_on=False)) == 5


def test_more_ranks_than_cpus_is_an_error():
    with pytest.raises(ValueError, match=r"3 local ranks need at least 3 usable CPUs; "
                                         r"there are 2 \(0-1\)"):
        place(Topology.flat(2), local_size=3)
    with pytest.raises(ValueError, match="there are 2"):
        place(Topology.flat(4), local_size=3, blacklist=[1, 2])


@pytest.mark.parametrize("kwargs,match", [
    (dict(local_size=0), "local_size"), (dict(local_size=1, gpus_per_rank=-1), "gpus_per_rank"),
    (dict(local_size=1, server_engine_threads=-1), "server_engine_threads"),
    (dict(local_size=2, gpus_per_rank=1), "need 2 GPUs; this machine has 0"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        place(Topology.flat(4), **kwargs)


def test_gpus_per_rank_and_too_few_gpus():
    gpus = tuple(Gpu(i, f"0000:{i + 1:02x}:00.0", 0 if i < 4 else 1) for i in range(8))
    topo = two_nodes(gpus=gpus)
    p = place(topo, local_size=4, gpus_per_rank=2)
    assert [r.gpus for r in p.ranks] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [r.numa_node for r in p.ranks] == [0, 0, 1, 1]
    assert [r.gpus for r in place(topo, local_size=2, gpus_per_rank=0).ranks] == [(), ()]
    # 3 GPUs for 4 ranks by default: CPU ranks, with a note
    few = place(Topology.flat(8, gpus[:3]), local_size=4)
    assert [r.gpu for r in few.ranks] == [None] * 4
    assert "4 local ranks but 3 GPU(s)" in few.notes[0]


def test_a_gpu_node_without_usable_cpus_hands_its_ranks_over():
    gpus = tuple(Gpu(i, f"0000:{i + 1:02x}:00.0", 0) for i in range(4))  # all on node 0
    topo = two_nodes(gpus=gpus)
    # node 0 keeps only CPUs 0-1: ranks 2 and 3 move to node 1, buffers stay near the GPU
    p = place(topo, local_size=4, visible_cpus=[0, 1, 4, 5, 6, 7])
    assert [r.numa_node for r in p.ranks] == [0, 0, 1, 1]
    assert [r.buffer_node for r in p.ranks] == [0, 0, 0, 0]
    assert [r.cpus for r in p.ranks] == [(0,), (1,), (4, 5), (6, 7)]
    assert any("moved to node 1" in n for n in p.notes)
    # node 0 blacklisted entirely
    p = place(topo, local_size=2, blacklist=range(4))
    assert [(r.numa_node, r.buffer_node) for r in p.ranks] == [(1, 0), (1, 0)]
    assert any("has no usable CPU" in n for n in p.notes)


def test_server_engine_threads_get_cores_of_their_own():
    topo = two_nodes(cores_per_node=8, threads=2)  # 16 cores, CPUs c and c+16 siblings
    p = place(topo, local_size=2, server_engine_threads=4)
    # at most 16 // 3 = 5 cores; 4 wanted, taken from the top of each node in turn
    assert p.server_cpus == (6, 7, 14, 15, 22, 23, 30, 31)
    assert p[0].cpus == (0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 20, 21)
    assert not set(p.server_cpus) & {c for r in p.ranks for c in r.cpus}
    # capped so that the ranks keep most of the machine
    assert len(place(topo, local_size=7, server_engine_threads=8).server_cpus) == 4
    # nothing to spare: the server shares
    tight = place(Topology.flat(2), local_size=2, server_engine_threads=4)
    assert tight.server_cpus == (0, 1) and "shares" in tight.notes[0]
    assert place(Topology.flat(2), local_size=1, server_engine_threads=4).server_cpus == (1,)


def test_placement_is_deterministic_and_covers_the_usable_cpus():
    rng = random.Random(5)
    for _ in range(200):
        cores_per_node = rng.randint(1, 6)
        threads = rng.choice((1, 2))
        gpu_count = rng.choice((0, 2, 4, 8))
        gpus = tuple(Gpu(i, f"0000:{i + 1:02x}:00.0", rng.choice((0, 1, None)))
                     for i in range(gpu_count))
        topo = two_nodes(cores_per_node, threads, gpus)
        blacklist = set(rng.sample(topo.cpus, rng.randint(0, len(topo.cpus) // 3)))
        usable = set(topo.cpus) - blacklist
        local_size = rng.randint(1, len(usable))
        threads_for_server = rng.choice((0, 0, 1, 4))
        kwargs = dict(local_size=local_size, blacklist=blacklist,
                      server_engine_threads=threads_for_server)
        p = place(topo, **kwargs)
        assert p == place(topo, **kwargs)
        seen: set[int] = set()
        for rank in p.ranks:
            assert rank.cpus and not seen & set(rank.cpus)
            assert {topo.node_of(c) for c in rank.cpus} == {rank.numa_node}
            seen |= set(rank.cpus)
            if gpu_count >= local_size:
                assert rank.gpus == (rank.local_rank,)
                node = gpus[rank.local_rank].numa_node
                assert rank.buffer_node == (rank.numa_node if node is None else node)
        if p.server_cpus and not any("shares" in n for n in p.notes):
            assert not seen & set(p.server_cpus)
            seen |= set(p.server_cpus)
        # every usable CPU of a node that hosts a rank is used; other nodes stay idle
        hosting = {r.numa_node for r in p.ranks}
        assert seen >= {c for c in usable if topo.node_of(c) in hosting}
        assert seen <= usable


# ------------------------------------------------------------------------------ settings
def test_placement_settings():
    cfg = C.load(env={})
    assert (cfg.placement.numa_on, cfg.placement.visible_cpu_cores,
            cfg.placement.cpu_blacklist) == (True, (), ())
    cfg = C.load(env={"BYTEPS_NUMA_ON": "0", "BYTEPS_VISIBLE_CPU_CORES": "0-3, 8",
                      "BYTEPS_CPU_BLACKLIST": "2"})
    assert (cfg.placement.numa_on, cfg.placement.visible_cpu_cores,
            cfg.placement.cpu_blacklist) == (False, (0, 1, 2, 3, 8), (2,))
    assert cfg.to_env() == {"BYTEPS_NUMA_ON": "0", "BYTEPS_VISIBLE_CPU_CORES": "0-3,8",
                            "BYTEPS_CPU_BLACKLIST": "2"}
    assert C.load(env=cfg.to_env()) == cfg
    assert C.load(env={}, overrides={"placement.cpu_blacklist": [3, 1]}).placement \
        .cpu_blacklist == (1, 3)
    for name in ("BYTEPS_NUMA_ON", "BYTEPS_VISIBLE_CPU_CORES", "BYTEPS_CPU_BLACKLIST"):
        assert name not in C.IGNORED_NAMES


@pytest.mark.parametrize("name,value,message", [
    ("BYTEPS_VISIBLE_CPU_CORES", "0-x", "BYTEPS_VISIBLE_CPU_CORES='0-x' (environment) is not a "
     "CPU list: '0-x' is not N or N-M (use e.g. 0-3,8,10-11)"),
    ("BYTEPS_CPU_BLACKLIST", "4-2", "BYTEPS_CPU_BLACKLIST='4-2' (environment) is not a CPU "
     "list: range 4-2 runs backwards"),
    ("BYTEPS_NUMA_ON", "maybe", "BYTEPS_NUMA_ON='maybe' (environment) is not a boolean"),
])
def test_bad_placement_settings(name, value, message):
    with pytest.raises(ConfigError) as info:
        C.load(env={name: value})
    assert str(info.value).startswith(message)


def test_bad_cpu_list_override():
    with pytest.raises(ConfigError, match="is not a CPU list"):
        C.load(env={}, overrides={"placement.cpu_blacklist": [-1]})


# ------------------------------------------------------------------------------ command line
def test_command_line(sysfs, monkeypatch, capsys):
    for key in list(os.environ):
        if key.startswith(("BYTEPS_", "DMLC_")):
            monkeypatch.delenv(key)
    dgx_like(sysfs, 4)
    assert T.main(["--sysfs", str(sysfs.root), "--local-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "NUMA node 1: CPUs 8-15,24-31" in out
    assert "local rank 7 -> CPUs 14-15,30-31, NUMA node 1, GPU 7, buffers on node 1" in out
    assert T.main(["--sysfs", str(sysfs.root), "--local-size", "1",
                   "--cuda-visible-devices", "6"]) == 0
    assert "local rank 0 -> CPUs 8-15,24-31, NUMA node 1, GPU 0" in capsys.readouterr().out
    assert T.main(["--sysfs", str(sysfs.root), "--local-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["topology"]["gpus"]) == 8 and data["error"] is None
    assert [r["cpus"] for r in data["placement"]["ranks"]][0] == [0, 1, 2, 3, 16, 17, 18, 19]
    monkeypatch.setenv("BYTEPS_CPU_BLACKLIST", "0-31")
    assert T.main(["--sysfs", str(sysfs.root)]) == 1
    assert "impossible: no usable CPU" in capsys.readouterr().out
    monkeypatch.setenv("BYTEPS_CPU_BLACKLIST", "x")
    assert T.main(["--sysfs", str(sysfs.root)]) == 2
    assert "BYTEPS_CPU_BLACKLIST='x'" in capsys.readouterr().err


def test_this_machine():
    """discover() on the real /sys of whatever runs the tests: consistent, never raising."""
    topo = discover()
    assert topo.cpus and sorted(c for n in topo.numa_nodes for c in n.cpus) == list(topo.cpus)
    assert sorted(c for core in topo.cores for c in core) == list(topo.cpus)
    assert [g.index for g in topo.gpus] == list(range(len(topo.gpus)))
    assert place(topo, local_size=1)[0].cpus
