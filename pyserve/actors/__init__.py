"""The microkernel: actors with bounded inboxes, run and supervised by an ActorSystem."""

from pyserve.actors.actor import Actor, ActorSystem, EngineDeadError

__all__ = ["Actor", "ActorSystem", "EngineDeadError"]
