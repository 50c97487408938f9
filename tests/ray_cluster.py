"""A local Ray cluster of two nodes on 127.0.0.1 (ray.cluster_utils.Cluster, one CPU each, token authentication
on) in a process of its own, driven by lines on stdin: "remove" (the worker node), "add" (a worker node), "quit".
It prints one JSON line at the start ({"address": ...}) and after each command ({"nodes": N}).

Ray starts threads in the process that makes the cluster; a test process that later forks (a Gluon DataLoader's
workers) could deadlock on a lock one of them held. Here they stay in this process.

    python -m tests.ray_cluster
"""
import json
import sys


def main():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                      "include_dashboard": False})
    workers = [c.add_node(num_cpus=1, node_ip_address="127.0.0.1")]
    c.wait_for_nodes()
    print(json.dumps({"address": c.address}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "remove" and workers:
            c.remove_node(workers.pop())
        elif cmd == "add":
            workers.append(c.add_node(num_cpus=1, node_ip_address="127.0.0.1"))
            c.wait_for_nodes()
        elif cmd == "quit":
            break
        print(json.dumps({"nodes": 1 + len(workers)}), flush=True)
    c.shutdown()


if __name__ == "__main__":
    main()
