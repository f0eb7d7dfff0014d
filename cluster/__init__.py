"""Ray at the edge: runtime start/connect, long-lived pair actors, shards through Ray Data, the pool for
bundled references and timed items (``pool``), the Serve endpoint. Every Ray call of the project is here.

Importing this package before Ray sets Ray's environment defaults (see ``cluster.runtime``)."""

from cluster.runtime import configure_env

configure_env()
