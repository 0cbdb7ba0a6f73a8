"""Train and evaluate an uncertainty-aware reward model: ``python train.py [overrides]`` (see README)."""

import sys

import hydra

from rewarduq_exp.cli import check_group_choices, register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    from rewarduq_exp.train_run import train  # heavy imports after Hydra has parsed the command line

    train(cfg)


if __name__ == "__main__":
    check_group_choices(sys.argv[1:])
    main()
