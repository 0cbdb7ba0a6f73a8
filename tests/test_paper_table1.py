"""The paper's tuned hyperparameters (RewardUQ Table 1) and paper-exact method defaults.

Every ``conf/tuned/<method>/<model>.yaml`` must hold Table 1's values, say where they come from, and, for ENS-LoRA,
use the anchor form the values were tuned with (the authors' unsquared L2 norm). The table below is transcribed
from the paper's text.

Reading of the extracted text: the rows of the 8B, 14B and 32B backbones hold only five numbers (the paper ran
ENS-LoRA and MCD-DPO up to 4B). The extraction puts the last two under MCD-DPO's columns; they are BAY-LIN's eta and
lambda (MCD-DPO's eta grid is 1e-7..1e-5, so an eta of 0.001 cannot be MCD-DPO's, and the authors' BAY-LIN configs
hold exactly these numbers).
"""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rewarduq_exp.runner.cli import register_resolvers

ROOT = Path(__file__).resolve().parents[1]

# model: (ENS-MLP eta, lambda, gamma), (ENS-LoRA eta, lambda, gamma), (MCD-DPO eta, lambda = dpo beta, p),
#        (BAY-LIN eta, lambda)
TABLE1 = {
    "qwen3-0.6b": ((1e-3, 0.0, 0.01), (1e-4, 0.01, 0.01), (1e-5, 0.01, 0.05), (0.01, 0.01)),
    "qwen3-1.7b": ((1e-3, 0.0, 0.01), (1e-4, 0.01, 0.01), (1e-5, 0.01, 0.1), (1e-3, 0.01)),
    "qwen3-4b": ((1e-3, 0.1, 0.0), (1e-4, 1e-3, 0.01), (1e-5, 0.01, 0.1), (1e-3, 1e-3)),
    "qwen3-8b": ((1e-3, 0.1, 0.0), None, None, (1e-3, 0.01)),
    "qwen3-14b": ((1e-3, 1.0, 0.0), None, None, (1e-3, 0.01)),
    "qwen3-32b": ((1e-3, 1.0, 0.01), None, None, (1e-3, 0.1)),
    "skywork-qwen3-0.6b": ((1e-3, 0.1, 0.01), (1e-4, 0.01, 0.01), (1e-5, 0.01, 0.1), (0.1, 1e-3)),
    "skywork-qwen3-1.7b": ((1e-3, 1.0, 0.01), (1e-4, 0.01, 0.01), (1e-5, 0.01, 0.1), (0.1, 0.01)),
    "skywork-qwen3-4b": ((1e-3, 0.1, 0.01), (1e-4, 1e-3, 0.01), (1e-5, 0.01, 0.05), (0.1, 0.1)),
    "skywork-qwen3-8b": ((1e-3, 1.0, 0.01), None, None, (0.1, 0.1)),
}
KEYS = {
    "ens_mlp": ("learning_rate", "reg_lambda", "center_gamma"),
    "ens_lora": ("learning_rate", "reg_lambda", "center_gamma"),
    "mcd_dpo": ("learning_rate", "dpo_beta", "dropout"),
    "bay_lin": ("learning_rate", "reg_lambda"),
}
METHODS = tuple(KEYS)


def compose_train(*overrides):
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("model", sorted(TABLE1))
@pytest.mark.parametrize("method", METHODS)
def test_tuned_file_holds_table1(method, model):
    row = TABLE1[model][METHODS.index(method)]
    path = ROOT / "conf" / "tuned" / method / f"{model}.yaml"
    if row is None:  # the paper did not run this method on this backbone: no tuned file, method defaults apply
        assert not path.exists()
        return
    text = path.read_text()
    assert "Table 1" in text  # every file says where its values come from
    cfg = compose_train(f"method={method}", f"model={model}")
    for key, value in zip(KEYS[method], row):
        assert cfg.method[key] == pytest.approx(value), (method, model, key)
    assert list(cfg.also_evaluate) == ["reward_bench"]  # the paper's final evaluation
    if method == "ens_lora":
        assert cfg.method.anchor == "l2"  # the form the authors' code trained (and Table 1 was tuned) with


def test_paper_exact_method_defaults():
    for method in METHODS:
        cfg = compose_train(f"method={method}")
        # The authors trained every method with the HF Trainer, which clips the gradient norm at 1.0.
        assert cfg.method.max_grad_norm == 1.0, method
    bay = compose_train("method=bay_lin").method
    assert bay.center_features is False and bay.hessian == "unweighted" and bay.beta == 0.5
    lora = compose_train("method=ens_lora").method
    assert lora.anchor == "l2" and lora.num_members == 8 and lora.batch_size == 16 and lora.center_gamma == 0.01
    from rewarduq_exp.methods.bay_lin import BayLin
    from rewarduq_exp.methods.ens_lora import EnsLoRA

    assert BayLin(device="cpu").center_features is False
    assert EnsLoRA(device="cpu").anchor == "l2"
