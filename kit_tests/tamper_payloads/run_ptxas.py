"""[attnkit-tamper] run_ptxas -- family (e), the one program a GPU compile runs: Triton's own ptxas.

Append to a correct kernels module. At import, run the ptxas that Triton bundles (triton/backends/nvidia/bin), as
Triton does to turn a kernel's PTX into a GPU binary. Expected: no program may run in a box, not even this one (the
learner's filter denies fork and exec); the error says so and the stage's checks fail with it.
"""


def _atk_run_ptxas():
    import os
    import subprocess

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    subprocess.run([ptxas, "--version"], capture_output=True, check=True, timeout=30)


_atk_run_ptxas()
