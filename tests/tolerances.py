"""Tolerances for model outputs of the tests' tiny float32 Qwen3 computed two ways, with the reason for each value.

The tests run in-process with ``device=auto``: on a GPU node both sides of such a comparison run on CUDA. PyTorch
keeps float32 matmuls in full float32 there (``torch.backends.cuda.matmul.allow_tf32`` is False by default, and this
project never sets it), but cuBLAS and SDPA pick kernels, and so reduction orders, by the shape of each batch, as the
CPU's kernels do: about 1e-7 relative per operation, amplified by the tiny model's sharp attention
(``attention_temperature: 0.01``, logits x100).
"""

# The same float32 model and inputs on one device, in other batches (other padding, rows per batch, shared prompts):
# up to ~2e-6 seen on a CPU; on an H100 a 1e-5 bound was missed by 2e-5. 1e-4 absolute and relative: a real fault (a
# wrong row, mask or pooled position) moves scores by orders of magnitude more.
OTHER_BATCHES = {"atol": 1e-4, "rtol": 1e-4}
# The same for a scalar, in pytest.approx's terms.
OTHER_BATCHES_APPROX = {"abs": 1e-4, "rel": 1e-4}
