"""Run by tests/rl/test_train_torchrun.py under torchrun: `rl.train`'s run with one fault injected on rank 1 only.

  nonfinite_loss  rank 1's second loss is NaN (its share of step 2)
  sync            rank 1's engine fails to install the adapter at step 1's sync
"""

import sys

import rl.train as train
from rl.session import Session
from tests.rl.test_train import compose_cfg


def inject(s: Session, fault: str) -> None:
    calls = [0]
    if fault == "nonfinite_loss":
        real = train.policy_loss

        def policy_loss(*args, **kwargs):
            calls[0] += 1
            loss, metrics = real(*args, **kwargs)
            return (loss * float("nan") if calls[0] == 2 else loss), metrics

        train.policy_loss = policy_loss
    elif fault == "sync":
        real = s.engine.load_adapter

        def load_adapter(*args, **kwargs):
            calls[0] += 1  # 1: the run's first sync, 2: rl.check's, 3: step 1's
            if calls[0] == 3:
                raise RuntimeError("injected: the engine worker died while installing the adapter")
            return real(*args, **kwargs)

        s.engine.load_adapter = load_adapter
    else:
        raise ValueError(f"unknown fault {fault!r}")


if __name__ == "__main__":
    fault, *overrides = sys.argv[1:]
    with Session(compose_cfg(overrides)) as session:
        if session.rank == 1:
            inject(session, fault)
        train.run(session)
