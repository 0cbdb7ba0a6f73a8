"""The fine-tuning base of the LoRA reward models: what ENS-LoRA and LA-LoRA share, one concept per module.

* :mod:`.method`: :class:`~.method.LoRARewardMethod`, the base class (settings, ``fit`` with micro-batches and the
  training loop, scoring batches, method.json);
* :mod:`.body`: the frozen backbone body, the LoRA configuration and the initial heads;
* :mod:`.texts`: tokenisation, shared prompts, padding, last-token pooling, autocast;
* :mod:`.steps`: the anchor and the data-parallel all-reduce of a training step;
* :mod:`.memory`: the one micro-batch / checkpointing / batched-forward choice of the run and the planner;
* :mod:`.adapters`: saved PEFT adapters, checked before PEFT reads them;
* :mod:`.la_lora` (with :mod:`.kfac`, :mod:`.posterior`, :mod:`.la_lora_memory`): LA-LoRA, one adapter with a
  Kronecker-factored Laplace posterior.

ENS-LoRA itself stays :mod:`rewarduq_exp.methods.ens_lora` (saved run folders name that class).
"""
