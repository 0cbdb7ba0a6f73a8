"""The fine-tuning base of the LoRA reward models: what they share, one concept per module.

* :mod:`.method`: :class:`~.method.LoRARewardMethod`, the base class (settings, ``fit`` with micro-batches and the
  training loop, scoring batches, method.json);
* :mod:`.body`: the frozen backbone body, the LoRA configuration and the initial heads;
* :mod:`.texts`: tokenisation, shared prompts, padding, last-token pooling, autocast;
* :mod:`.steps`: the anchor and the data-parallel all-reduce of a training step;
* :mod:`.memory`: the one micro-batch / checkpointing / batched-forward choice of the run and the planner;
* :mod:`.adapters`: saved PEFT adapters, checked before PEFT reads them.

ENS-LoRA itself stays :mod:`rewarduq_exp.methods.ens_lora` (saved run folders name that class).
"""
