"""Starting runs: distributed initialisation from torchrun / OpenMPI / MPICH / Slurm environments
(``distributed``), YAML configs per system (``configs/``), the launch scripts, the results
summarizer (``summarize``), MLPerf's system description and submission package.

Imports: ``common`` only; never ``bert``, ``kernels`` or ``data``.
"""
