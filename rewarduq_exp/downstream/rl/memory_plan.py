"""What ``task=rl`` holds on its device, planned before anything loads (``task.plan=true`` prints it and runs
nothing), from the policy's and the reward model's shapes (:mod:`rewarduq_exp.models.shapes`) and the task's sizes.

Everything is float32 (the policy, its reference and the optimizer, as the task loads them). Sequences are counted
at the prompt's upper bound (``PROMPT_TOKENS``) plus ``task.max_tokens``, so the peaks are upper bounds:

- ``sft``: the policy's weights, gradients and Adam's two moments (16 bytes a parameter), the activations a batch
  of ``task.sft.batch_size`` keeps for backward, its logits and their log-softmax;
- ``rl step``: the same for the policy on ``prompts_per_step x generations`` completions, the reference the KL is
  measured against and, where the objective is ``kl``, the trainer's own reference copy (4 bytes a parameter each),
  the generation's KV cache, the logits over the completions (the trainer's log-probabilities and its entropy), and
  the reward model's backbone scoring them;
- ``measurement``: both policies' logits over 16 samples at a time in float64 (the exact per-token KL).

FLOPs are per RL run: generation 2 P per token, the policy's forward and backward 6 P per token, the references'
forwards 2 P per token, the reward model's 2 P_rm per scored token.
"""

from __future__ import annotations

from rewarduq_exp.models.activation_memory import inference_token_bytes, kv_cache_elems, training_activations
from rewarduq_exp.models.memory_plan import Phase, Plan
from rewarduq_exp.models.shapes import architecture

PROMPT_TOKENS = 64          # the worlds' prompts are 20-40 tokens under a chat template
MEASURE_CHUNK = 16          # samples per forward of the KL measurement (policy_samples.sequence_kl)
DEFAULT_TFLOPS = 0.1        # a laptop CPU core or two; a GPU node: task.plan_tflops=400


def reference_label(count: int) -> str:
    return "reference policies (measurement, trainer's copy)" if count > 1 else "reference policy (measurement)"


def plan_rl(task, policy_cfg, reward_cfg, device: str, cache_dir=None) -> Plan:
    a = architecture(policy_cfg, cache_dir)
    rm = architecture(reward_cfg, cache_dir)
    p, p_rm = a.params_causal_lm, rm.params_body
    length = PROMPT_TOKENS + int(task.max_tokens)
    rows = int(task.prompts_per_step) * int(task.generations)
    math_kernel = device == "cpu"
    references = 2 if "kl" in list(task.objectives) else 1
    sft_rows = int(task.sft.batch_size)
    logits = 3 * a.vocab * 4                      # logits, log-softmax and its exp / gather, float32, per token
    phases = [
        Phase("sft", {"policy weights, gradients, Adam moments (float32)": 16.0 * p,
                      f"activations kept for backward ({sft_rows} rows x {length} tokens)":
                          training_activations(a, sft_rows, length, 4, math_kernel, False),
                      "logits over the vocabulary": sft_rows * length * logits}),
        Phase("rl step", {"policy weights, gradients, Adam moments (float32)": 16.0 * p,
                          reference_label(references): 4.0 * p * references,
                          f"generation KV cache ({rows} completions x {length} tokens)":
                              rows * length * kv_cache_elems(a) * 4.0,
                          "activations kept for backward": training_activations(a, rows, length, 4, math_kernel, False),
                          "logits over the vocabulary": rows * int(task.max_tokens) * logits,
                          "reward model backbone (weights)": 4.0 * p_rm,
                          "reward model scoring the completions": rows * length * inference_token_bytes(
                              rm, length, 4, math_kernel)}),
        Phase("measurement", {"policy and reference weights": 4.0 * p * 2,
                              f"log-probabilities of {MEASURE_CHUNK} samples, both policies (float64)":
                                  2 * 3 * MEASURE_CHUNK * int(task.max_tokens) * a.vocab * 8.0,
                              "activations of a no-grad forward": MEASURE_CHUNK * length * inference_token_bytes(
                                  a, length, 4, math_kernel)}),
    ]
    steps, evals = int(task.steps), len({0, *range(int(task.eval_every), int(task.steps) + 1,
                                                     int(task.eval_every)), int(task.steps)})
    tokens = rows * int(task.max_tokens)
    flops = {"generation (per RL run)": 2.0 * p * tokens * steps,
             "policy forward and backward (per RL run)": 6.0 * p * rows * length * steps,
             "references' forwards (per RL run)": 2.0 * p * rows * length * steps * (references - 1),
             "reward model scoring (per RL run)": 2.0 * p_rm * rows * length * steps,
             "measurements (per RL run)": evals * int(task.eval_samples) * (2.0 * p * int(task.max_tokens)
                                                                           + 4.0 * p * length + 2.0 * p_rm * length)}
    tflops = float(task.get("plan_tflops") or DEFAULT_TFLOPS)
    return Plan(method="rl", model=a.name, device=device, dtype="float32", params_total=p, params_trainable=p,
                phases=phases, flops=flops, tflops=tflops, n_train=rows * steps, n_eval=int(task.eval_samples),
                max_length=length,
                notes=[f"policy {a.name} ({p:,} parameters), reward model backbone {rm.name} ({p_rm:,})",
                       "n_train: completions trained on per RL run; n_eval: samples per measurement",
                       "time: one RL run at the given TFLOPS (task.plan_tflops); a study runs one per objective, "
                       "coefficient and seed"])
