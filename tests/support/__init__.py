"""What the tests share, none of it a test: processes, conditions, worlds, hosts.

authz_world.py      real CURVE sockets and keys for the authorization tests
child.py            a child process that reports JSON lines (on kvxferd.launch)
conditions.py       waiting on a condition with a deadline (no sleep as synchronisation)
etcd_server.py      a real etcd on loopback for the discovery tests
hostile.py          pre-built hostile messages for the frame fuzzing
hosts.py            hosts as network namespaces on a bridge, NIXL over UCX TCP between them
hosts_experiment.py the link-cut experiment behind docs/hosts.md (python -m tests.support.hosts_experiment)
peers.py            sender and receiver peers as child processes (python -m tests.support.peers)
"""
