"""A worker's checkpoints for one attempt, cut along its seams (the trainer sees one CheckpointSession).

    context.py       what the parts share: the store, fencing, the node-local copy, the checkpointer, the
                     run's identity as agreed at restore and registration
    restore.py       the restore plan: which source a start resumes from (this node's copy in memory, the
                     durable store, checkpoint.resume_from) and loading it on every rank
    registration.py  the run's hold, the attempt number (fencing), the run record: one place, used by the
                     worker, the local launcher and the node command
    hold.py          the run's hold itself (standard library and fsspec: the launchers read it without torch)
    saver.py         when to save and every kind of save: periodic, best, stop, emergency, final
    checkpoints.py   CheckpointSession: the trainer's one handle on the parts above

Nothing is imported here: the launchers import session.hold without torch.
"""
