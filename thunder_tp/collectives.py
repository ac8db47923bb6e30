"""Collective symbols of the TP group, their conjugate grads and torch.distributed implementations."""

from thunder.extend import OperatorExecutor, register_executor

comm_executor = OperatorExecutor("thunder_tp_comm", version="0.1")
register_executor(comm_executor)
