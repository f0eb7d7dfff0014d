"""Ray at the edge: runtime start/connect, long-lived pair actors, shards through Ray Data.

Importing this package before Ray sets Ray's environment defaults (see ``cluster.runtime``)."""

from cluster.runtime import configure_env

configure_env()
