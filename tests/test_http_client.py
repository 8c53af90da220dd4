"""The transport's own HTTP client: not huggingface_hub's, one per process, never across fork.

Against the loopback fake Hub (with its CDN origin) and loopback file servers, over plain
HTTP and TLS. ``make test`` runs this file next to every huggingface_hub release it tests.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from servers.fake_hub import serve_fake_hub, write_reference_shard
from servers.http_server import ShardServer, serve_directory

from pyg_atompack import hub
from pyg_atompack.transport import RemoteOfflineError, RetryPolicy, TransportError, http, transfers

REPO = "org/remote"
TESTS_DIR = Path(__file__).resolve().parent
FAST = RetryPolicy(retries=1, backoff=0.01, max_backoff=0.05, jitter=0.1, timeout=5.0,
                   connect_timeout=2.0)


@pytest.fixture(scope="module")
def shard_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote")
    write_reference_shard(root / "train" / "part_0.atp", 3, 2, seed=1)
    (root / "README.md").write_text("# remote\n")
    return root


@pytest.fixture
def server(shard_root):
    for fake in serve_fake_hub():
        fake.commit(REPO, shard_root)
        yield fake


# a child process: huggingface_hub's HTTP client refuses to be made, then every kind of
# remote read of the package runs; huggingface_hub's own calls must fail
_WITHOUT_HF_CLIENT = """
import sys, tempfile
import huggingface_hub

def refuse(*args, **kwargs):
    raise RuntimeError("huggingface_hub's HTTP client was asked for")

if hasattr(huggingface_hub, "set_client_factory"):  # 1.x and later
    huggingface_hub.set_client_factory(refuse)
    huggingface_hub.close_session()
else:  # 0.x
    huggingface_hub.configure_http_backend(refuse)

from pyg_atompack import hub
from pyg_atompack.hub import transfer
from pyg_atompack.transport import RetryPolicy, transfers

endpoint, plain = sys.argv[1:3]
sha = hub.resolve_revision("org/remote", endpoint=endpoint)
files = {f.name: f for f in hub.list_remote_files("org/remote", revision=sha, endpoint=endpoint)}
head = transfer.fetch_range(files["train/part_0.atp"], 0, 4)  # the CDN redirect
readme = transfer.fetch_bytes(files["README.md"])  # the relative redirect
reader = hub.open_hub_atp("org/remote", "train", revision=sha, endpoint=endpoint,
                          cache_dir=tempfile.mkdtemp())
energies = [float(reader[i].energy) for i in range(len(reader))]
body = transfers.fetch_range(plain, 0, 4, policy=RetryPolicy())
try:
    huggingface_hub.HfApi(endpoint=endpoint).dataset_info("org/remote")
    trapped = "huggingface_hub's client worked"
except RuntimeError as error:
    trapped = str(error)
print(head, readme, energies, body, trapped)
"""


def test_reads_never_use_huggingface_hubs_client(server, shard_root, tmp_path):
    """A huggingface_hub whose client cannot be made: every read of the package still works."""
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "blob.bin").write_bytes(b"BLOB and more")
    for plain in serve_directory(tmp_path / "www"):
        env = server.subprocess_env()
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR.parent),
                                             os.environ.get("PYTHONPATH", "")])
        result = subprocess.run(
            [sys.executable, "-c", _WITHOUT_HF_CLIENT, server.endpoint, plain.url("blob.bin")],
            env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [
            "b'ATPK'", "b'#", "remote\\n'", "[100.0,", "101.0,", "102.0]", "b'BLOB'",
            "huggingface_hub's", "HTTP", "client", "was", "asked", "for"]
        assert plain.requests[-1].path == "/blob.bin"
        assert any(r.origin == "cdn" for r in server.requests)


def test_a_forked_child_makes_its_own_client_and_keeps_the_trust_store(server):
    """The child never touches its parent's connection; the parent's keeps working."""
    sha = hub.resolve_revision(REPO, endpoint=server.endpoint, policy=FAST)
    parent_client = http._client()
    trust_store = http._trust_store
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code, never return into pytest
        code = 1
        try:
            own = http._client()
            code = 2 if own is parent_client else 3 if http._trust_store is not trust_store \
                else 0 if hub.resolve_revision(REPO, endpoint=server.endpoint,
                                               policy=FAST) == sha else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert hub.resolve_revision(REPO, endpoint=server.endpoint, policy=FAST) == sha
    assert http._client() is parent_client
    ports = [r.client_port for r in server.requests]
    # parent, child (a new connection), parent again on its first connection
    assert len(ports) == 3 and ports[0] == ports[2] != ports[1]


def test_threads_share_one_client():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        clients = set(map(id, pool.map(lambda _: http._client(), range(64))))
    assert clients == {id(http._client())}


def _self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_https_trusts_ssl_cert_file_and_nothing_else(tmp_path, monkeypatch):
    """``SSL_CERT_FILE`` names the trust store; without it a self-signed server is refused."""
    cert_file, key_file = _self_signed(tmp_path)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "blob.bin").write_bytes(b"over TLS")
    server = ShardServer(tmp_path / "www")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.start()
    url = f"https://127.0.0.1:{server.server_address[1]}/blob.bin"
    try:
        # a new process reads the variables once: forget this one's client and trust store
        for name in ("_process_client", "_trust_store"):
            monkeypatch.setattr(http, name, None)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))
        assert transfers.fetch_range(url, 0, 8, policy=FAST) == b"over TLS"
        for name in ("_process_client", "_trust_store"):
            monkeypatch.setattr(http, name, None)
        monkeypatch.delenv("SSL_CERT_FILE")
        with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
            transfers.fetch_range(url, 0, 8, policy=FAST)
        assert [r.path for r in server.requests] == ["/blob.bin"]  # the refused one never got in
    finally:
        server.stop()


def test_offline_mode_refuses_before_connecting(server, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.HubOfflineError, match="HF_HUB_OFFLINE=1"):
        hub.resolve_revision(REPO, endpoint=server.endpoint, policy=FAST)
    with pytest.raises(RemoteOfflineError, match=r"127\.0\.0\.1.*HF_HUB_OFFLINE=1"):
        transfers.fetch_range(f"{server.endpoint}/anything", 0, 1, policy=FAST)
    assert server.requests == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert hub.resolve_revision(REPO, endpoint=server.endpoint, policy=FAST)


def test_every_test_file_of_the_fake_hub_runs_next_to_each_release():
    """``REMOTE_TESTS`` in the Makefile (run once per huggingface_hub release) lists every
    test file that starts the fake Hub."""
    import re

    makefile = (TESTS_DIR.parent / "Makefile").read_text(encoding="utf-8")
    value = re.search(r"^REMOTE_TESTS := ((?:.*\\\n)*.*)$", makefile, re.M).group(1)
    listed = {entry.split("::")[0] for entry in value.replace("\\\n", " ").split()}
    assert all((TESTS_DIR.parent / entry).is_file() for entry in listed), listed
    starting = {f"tests/{path.name}" for path in TESTS_DIR.glob("test_*.py")
                if re.search(r"\b(serve_fake_hub|FakeHub)\(", path.read_text(encoding="utf-8"))}
    assert "tests/test_http_client.py" in starting
    assert starting <= listed, starting - listed
