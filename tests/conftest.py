"""Makes tests/ importable for helpers shared across test folders (filekit)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import uuid  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run only when ``-m`` names them (``bash scripts/test.sh -m slow``): the
    suite stays within its 15 minutes on 2 cores."""
    if "slow" in (config.getoption("markexpr", default="") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1, with a bucket "ckpt"."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                 region_name="us-east-1").create_bucket(Bucket="ckpt")
    yield endpoint
    server.stop()


@pytest.fixture()
def s3_url(s3_server):
    """A fresh store URL in the bucket and the fsspec options that reach it (a non-default endpoint and
    explicit credentials: nothing comes from the environment)."""
    opts = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": s3_server, "region_name": "us-east-1"},
            "skip_instance_cache": True}
    return f"s3://ckpt/run-{uuid.uuid4().hex[:8]}", opts


@pytest.fixture()
def s3_proxy(s3_server):
    """A fault-injecting proxy (tests/s3proxy.py) in front of the moto server, with no rules yet: reach
    it with ``s3_proxy.options(opts)`` on the options of ``s3_url`` (issue 24)."""
    from s3proxy import FaultProxy

    with FaultProxy(s3_server) as proxy:
        yield proxy


def pytest_addoption(parser):
    # The object-store soak runs about a minute in CI; pass more to soak longer (issue 24).
    parser.addoption("--soak-seconds", type=float, default=60.0,
                     help="how long tests/writer/test_s3_soak.py cuts through the fault proxy (default 60)")
