"""glibc's mmap threshold fixed for LA-LoRA's memory-budgeted CPU passes (rewarduq_exp.core.heap)."""

import platform
import subprocess
import sys
import textwrap

import pytest

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
    method.device, method.score_batch_size = __import__("torch").device("cpu"), None
    monkeypatch.setattr(LaLoRA, "_pass_tokens", lambda self, longest, jacobians: 64)
    batches = method._grad_passes([[1] * 10, [2] * 20, [3] * 5], jacobians=True)
    assert calls == [1] and sorted(int(i) for b in batches for i in b) == [0, 1, 2]
