"""Exit codes, once: what a worker, a command or the launcher tells the process that started it.

Workers (`python -m elastic_qa.train`):
    0   done: the final state is committed and verified
    1   anything else, including a final state that could not be committed (torchrun restarts the group)
    2   bad input: config, data, a checkpoint that does not fit, an unwritable run or checkpoint directory
    75  stopped under torchrun (SIGTERM, SIGINT, SIGHUP) after saving: the agents regroup
    76  its torchrun agent died (after saving, or once dist.agent_lost_grace ran out)
    128 + n  a single process stopped by signal n after saving (130 SIGINT, 129 SIGHUP, 143 SIGTERM)
Commands (`elastic-qa ...`, `python -m chaos ...`, the launcher): 0 ok, 1 a check failed, 2 bad input;
the launcher's `start` stopped by a signal after saving: 128 + n (130 Ctrl-C, 143 SIGTERM); `elastic-qa`
whose output's reader left early (`| head`): 141, as a Unix tool that SIGPIPE ends.
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_REGROUP = 75
EXIT_AGENT_LOST = 76


class UsageError(Exception):
    """Bad input on a command line: printed as one line, exit code 2."""
