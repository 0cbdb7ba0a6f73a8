"""glibc's malloc policy set around a phase (rewarduq_exp.core.heap): large frees back to the OS for LA-LoRA's
memory-budgeted CPU passes, freed blocks kept while a head trains on cached features."""

import contextlib
import os
import platform
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# A child process (the threshold is process-wide): 100 blocks of 1 MiB, each followed by a small block that pins the
# heap, after one 4 MiB block was freed (which raises glibc's sliding threshold past 1 MiB). Prints the MiB the
# blocks added and the MiB still held once they are freed.
CHILD = textwrap.dedent("""
    import os, sys
    def rss():
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if sys.argv[1] == "fixed":
        from rewarduq_exp.core import heap
        assert heap.return_large_frees_to_os() and heap.return_large_frees_to_os()
    x = bytearray(4 << 20); del x
    base = rss()
    big, small = [], []
    for _ in range(100):
        big.append(bytearray(1 << 20)); small.append(bytearray(600))
    grown = rss() - base
    del big
    print(grown >> 20, (rss() - base) >> 20)
""")


def held_after_free(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True).stdout
    grown, held = map(int, out.split())
    return grown, held


@glibc
def test_freed_large_blocks_go_back_to_the_os_once_the_threshold_is_fixed():
    grown, held = held_after_free("default")
    assert grown >= 90 and held >= 90   # glibc's default: the heap keeps them (why LA-LoRA's scoring ran out)
    grown, held = held_after_free("fixed")
    assert grown >= 90 and held <= 5


@glibc
def test_la_lora_fixes_the_threshold_before_its_cpu_passes(monkeypatch):
    from rewarduq_exp.core import heap
    from rewarduq_exp.methods.lora.la_lora import LaLoRA

    calls = []
    monkeypatch.setattr(heap, "return_large_frees_to_os", lambda: calls.append(1) or True)
    method = LaLoRA.__new__(LaLoRA)
    method.device, method.score_batch_size = torch.device("cpu"), None
    monkeypatch.setattr(LaLoRA, "_pass_tokens", lambda self, longest, jacobians: 64)
    batches = method._grad_passes([[1] * 10, [2] * 20, [3] * 5], jacobians=True)
    assert calls == [1] and sorted(int(i) for b in batches for i in b) == [0, 1, 2]


# Ten 10 MiB blocks freed, inside keeping_freed_memory() or not: MiB still held just after the frees, and once the
# phase is over.
KEEP_CHILD = textwrap.dedent("""
    import contextlib, os, sys
    from rewarduq_exp.core import heap
    def rss():
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    base = rss()
    with heap.keeping_freed_memory() if sys.argv[1] == "keep" else contextlib.nullcontext():
        blocks = [bytearray(10 << 20) for _ in range(10)]
        del blocks
        inside = rss() - base
    print(inside >> 20, (rss() - base) >> 20)
""")


@glibc
def test_a_training_phase_keeps_freed_blocks_and_gives_them_back_after():
    def held(mode, **env):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env
        out = subprocess.run([sys.executable, "-c", KEEP_CHILD, mode], capture_output=True, text=True, check=True,
                             env=env)
        return tuple(map(int, out.stdout.split()))

    assert held("default")[0] <= 5        # glibc: 10 MiB blocks are mmapped, and unmapped when freed
    inside, after = held("keep")
    assert inside >= 90 and after <= 5    # kept for the next step's allocations, then returned
    # thresholds the environment fixed for the whole process stay as they are
    assert held("keep", MALLOC_MMAP_THRESHOLD_="65536")[0] <= 5
    assert held("keep", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")[0] <= 5


@glibc
def test_the_policy_before_a_kept_phase_returns_after_it(monkeypatch):
    from rewarduq_exp.core import heap

    calls = []
    monkeypatch.setattr(heap, "_set", lambda mmap, trim: calls.append((mmap, trim)) or True)
    monkeypatch.setattr(heap, "_policy", "return")
    with heap.keeping_freed_memory():
        assert heap._policy == "keep" and calls[-1] == (heap.GLIBC_MMAP_MAX, heap.KEEP_TRIM_BYTES)
        with heap.keeping_freed_memory():   # nested: nothing changes
            assert len(calls) == 1
    assert heap._policy == "return" and calls[-1] == (heap.MMAP_THRESHOLD_BYTES, 128 * 1024)


def test_feature_heads_train_with_freed_blocks_kept_on_a_cpu(monkeypatch):
    from rewarduq_exp.core import heap
    from rewarduq_exp.methods.ens_mlp import EnsMLP

    phases = []

    @contextlib.contextmanager
    def recording():
        phases.append("start")
        yield
        phases.append("end")

    monkeypatch.setattr(heap, "keeping_freed_memory", recording)
    monkeypatch.setattr(EnsMLP, "_fit_features", lambda self, zc, zr, w: phases.append("fit"))
    encoder = type("Encoder", (), {"encode_pairs": lambda self, frame, desc: (torch.zeros(len(frame), 4),) * 2})()
    method = EnsMLP(encoder, num_heads=2, device="cpu", show_progress=False)
    method.fit(pd.DataFrame({"weight": [1.0, 1.0]}))
    assert phases == ["start", "fit", "end"]
