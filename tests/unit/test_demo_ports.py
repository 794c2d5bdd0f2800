"""Port picking for the demo/test deployments (no SGLang needed)."""

import socket

from sglang_kvguard.demo.deployment import _ephemeral_range, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    lo, _ = _ephemeral_range()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    if lo - 20000 >= 1000:
        # bind(0)/ZMQ random ports come from the ephemeral range; ours must not.
        assert all(20000 <= p < lo for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_excluded_and_busy_ports_are_skipped():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        held = busy.getsockname()[1]
        first = free_ports(5)
        again = free_ports(50, exclude=first + [held])
        assert not set(again) & set(first)
        assert held not in again


def _argv(role, **kw):
    from sglang_kvguard.demo.deployment import _PORT_NAMES, PDDeployment, ReleaseInfo

    d = PDDeployment(model_path="/nonexistent", log_dir="/tmp/kvguard-unit-argv", **kw)
    d.release = ReleaseInfo(version="0.5.19", root="/x", has_mooncake_tcp=True, has_retraction_backup=False,
                            needs_host_tensor_shim=False, plugins_in_scheduler=True, has_router=True)
    d.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES))))
    return d, d._server_argv(role)


def test_each_server_gets_its_own_rendezvous_port_below_the_ephemeral_range():
    # SGLang < 0.5.23 picks --nccl-port with bind(0) (ephemeral) and binds it seconds
    # later; the other server's sockets took it once in CI (EADDRINUSE, scheduler died).
    lo, _ = _ephemeral_range()
    seen = []
    for role in ("prefill", "decode"):
        d, argv = _argv(role)
        assert argv.count("--nccl-port") == 1
        port = int(argv[argv.index("--nccl-port") + 1])
        assert port == d.ports[f"{role}_nccl"]
        if lo - 20000 >= 1000:
            assert 20000 <= port < lo
        seen.append(port)
    assert len(set(seen)) == 2 and len(set(d.ports.values())) == len(d.ports)


def test_a_caller_supplied_rendezvous_port_wins():
    _, argv = _argv("decode", decode_extra_args=["--nccl-port", "23456"])
    assert argv.count("--nccl-port") == 1
    assert argv[argv.index("--nccl-port") + 1] == "23456"


def test_a_scale_out_deployment_gives_every_node_its_own_ports_and_the_router_every_node():
    from sglang_kvguard.demo.deployment import PDDeployment, ReleaseInfo

    d = PDDeployment(model_path="/nonexistent", log_dir="/tmp/kvguard-unit-argv", prefill_nodes=2, decode_nodes=2)
    d.release = ReleaseInfo(version="0.5.10", root="/x", has_mooncake_tcp=False, has_retraction_backup=False,
                            needs_host_tensor_shim=False, plugins_in_scheduler=True, has_router=True)
    names = d.port_names()
    d.ports = dict(zip(names, free_ports(len(names))))
    assert d.node_names == ["prefill", "prefill2", "decode", "decode2"]
    assert len(set(d.ports.values())) == len(names)
    seen = {}
    for n in d.node_names:
        argv = d._server_argv(n)
        mode = argv[argv.index("--disaggregation-mode") + 1]
        assert mode == ("prefill" if n.startswith("prefill") else "decode")
        seen[n] = (int(argv[argv.index("--port") + 1]), int(argv[argv.index("--nccl-port") + 1]),
                   int(argv[argv.index("--disaggregation-bootstrap-port") + 1]))
    ports = [p for v in seen.values() for p in v[:2]]
    assert len(set(ports)) == len(ports)  # HTTP and rendezvous ports all distinct
    assert seen["prefill"][2] != seen["prefill2"][2]  # each prefill its own bootstrap server
    r = d._router_argv()
    prefills = [(r[i + 1], int(r[i + 2])) for i, a in enumerate(r) if a == "--prefill"]
    decodes = [r[i + 1] for i, a in enumerate(r) if a == "--decode"]
    assert prefills == [(d.url("prefill"), seen["prefill"][2]), (d.url("prefill2"), seen["prefill2"][2])]
    assert decodes == [d.url("decode"), d.url("decode2")]
