"""The trainer's parts (elastic_qa/trainer.py runs the loop): the start-up freeze probe, one step's
micro-batches, and evaluation with the best tracker."""
