"""Audit a whole private training run, and see what reproduction seeds do to the guarantee.

Two DP-SGD runs at a claimed ε = 2 (δ = 1e-5), each audited end to end by
:func:`pl_dp.audit_run.audit_run` (Steinke, Nasr & Jagielski 2023: 1000 canaries, one real run with
a checkpoint and a kill-and-resume, an adversary who replays the public config):

* secrets from OS entropy (the default): the lower bound stays far below the claim;
* reproduction mode, ``noise_seed=`` and ``sampling_seed=`` in the config: the adversary's replay
  reproduces the noise and the batches, reads every canary's membership off the released models,
  and the lower bound exceeds the claim — the run's ε is no guarantee against whoever knows the seeds.

    python examples/audit_a_whole_run.py           # about a minute on 2 CPU cores
    pl-dp audit --run --sampling_seed 7            # the same audit from the command line
"""

from __future__ import annotations

from pl_dp import PrivacySpec
from pl_dp.audit_run import RunAuditResult, audit_run


def main(canaries: int = 1000, steps: int = 1000, accountant: str = "prv") -> dict[str, RunAuditResult]:
    privacy = PrivacySpec(epsilon=2.0, delta=1e-5, accountant=accountant)
    results = {
        "secrets from OS entropy (default)": audit_run(privacy=privacy, canaries=canaries, steps=steps),
        "reproduction mode (noise_seed, sampling_seed)": audit_run(
            privacy=privacy, canaries=canaries, steps=steps, noise_seed=0, sampling_seed=0
        ),
    }
    for name, result in results.items():
        print(f"{name}:\n  {result}")
    return results


if __name__ == "__main__":
    main()
