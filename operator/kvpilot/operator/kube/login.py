"""The operator's credentials: the in-cluster service account, else a kubeconfig.

A kubeconfig is read by the `kubernetes` client, so the operator logs in the way kubectl
does: exec credential plugins (EKS, GKE, AKS), OIDC, token files, client certificates.
A token that expires carries its expiry, so kopf and the handlers' client log in again
before it passes. Without either source, or when the kubeconfig cannot give credentials,
`LoginError` says so in one line (the CLI prints it and exits 1); a kubeconfig that is no
kubeconfig (YAML that does not parse, not a mapping) is a `KubeconfigError` (exit 2: the
user's file to fix, not a cluster to wait for).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import kopf
import yaml

DEFAULT_KUBECONFIG = "~/.kube/config"


class LoginError(RuntimeError):
    """No usable credentials; the message is one line naming the source and the fix."""


class KubeconfigError(LoginError):
    """A kubeconfig file that cannot be read as one; the message names the file and line."""


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _errors_caught() -> Iterator[list[str]]:
    """Gives the errors the kubernetes client logs meanwhile (an exec plugin's failure is one),
    keeping them off the log: the LoginError carries them."""
    root = logging.getLogger()
    collector, saved = _Collector(), root.handlers[:]
    root.handlers[:] = [collector]
    try:
        yield collector.messages
    finally:
        root.handlers[:] = saved


def kubeconfig_login(paths: str | None = None) -> kopf.ConnectionInfo:
    """Gives the credentials of the kubeconfig's current context (`paths`: like KUBECONFIG,
    default $KUBECONFIG, else ~/.kube/config); raises LoginError when there are none."""
    from kubernetes import client
    from kubernetes.config import ConfigException, kube_config

    paths = paths or os.environ.get("KUBECONFIG") or DEFAULT_KUBECONFIG
    try:
        merged = kube_config.KubeConfigMerger(paths)
    except (yaml.YAMLError, AttributeError, TypeError, OSError) as exc:  # AttributeError,
        # TypeError: YAML that is a list or a string, where the merger reads a mapping
        reason = " ".join(str(exc).split())
        raise KubeconfigError(f"kubeconfig {paths} is not a readable kubeconfig ({reason}): "
                              "fix the file, or point KUBECONFIG at another") from exc
    if merged.config is None:
        raise LoginError(f"no cluster: no service account (not in a pod) and no kubeconfig at "
                         f"{paths}: set KUBECONFIG, or run the operator in the cluster")
    config = client.Configuration()
    with _errors_caught() as errors:
        try:
            loader = kube_config.KubeConfigLoader(config_dict=merged.config)
            loader.load_and_set(config)
        except (ConfigException, KeyError, ValueError, OSError) as exc:
            raise LoginError(f"kubeconfig {paths}: {exc}") from exc
    if errors:
        raise LoginError(f"kubeconfig {paths}: {errors[-1]}".replace("\n", " "))
    scheme, _, token = (config.api_key.get("BearerToken") or "").partition(" ")
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        scheme=scheme or None, token=token or None,
        certificate_path=config.cert_file, private_key_path=config.key_file,
        expiration=getattr(loader, "expiry", None))


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Gives the in-cluster service account's credentials, else the kubeconfig's; raises
    LoginError when neither gives any."""
    return kopf.login_with_service_account(settings=settings) or kubeconfig_login()


async def check_reachable(info: kopf.ConnectionInfo) -> None:
    """Asks the API server for /version with `info`; raises LoginError naming the server when
    it cannot be reached or refuses the credentials (so the operator does not start blind)."""
    import aiohttp

    from kvpilot.operator.kube.client import Kube
    from kvpilot.operator.kube.errors import KubeError

    kube = Kube(info)
    try:
        await kube.version()
    except KubeError as exc:
        raise LoginError(f"the API server at {info.server} refused the credentials: "
                         f"{exc}") from exc
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise LoginError(f"cannot reach the API server at {info.server}: "
                         f"{exc or type(exc).__name__}") from exc
    finally:
        await kube.close()
