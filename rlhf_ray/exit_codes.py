"""Exit codes of the `rlhf-ray` commands (the CLI and the quickstart)."""

EXIT_OK = 0
EXIT_PLAN_DOES_NOT_FIT = 1
"""The resource plan or the memory it needs does not fit the cluster."""
EXIT_BAD_CONFIG = 2
"""A config, an override or an input file is wrong; the message names the file, line and field."""
EXIT_JOB_FAILED = 3
"""The job started and failed: the terminal names the actor and shows the first error; <output_dir>/logs/error.log
has every traceback (jobs/failure.py)."""
