"""Ray for the replica set: start a local instance or join a cluster, deploy the replicas, stop.

Ray is started here (a local instance, dashboard off, listening on 127.0.0.1 only:
``start_local_ray``) unless ``ray_address`` names a cluster to join; what ``ReplicaSet.open``
started, it stops (``stop_app``). Ray Serve's HTTP proxy is not used: the stream a client reads
must come from the process that holds its journal. Ray is imported only inside these functions:
without the ``cluster`` extra the rest of the runtime still imports.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import structlog

from llamactor.protocol.errors import ConfigError
from llamactor.runtime.service.config import RuntimeConfig

log = structlog.get_logger("llamactor.replicas")

EXTRA = "pip install 'llamactor[cluster]'"
DEPLOYMENT = "llamactor"  # the replica set's deployment, one per application
# A local Ray instance started here runs quieter than Ray's defaults (measured idle, one replica:
# 11.6 CPU ticks a second in Ray's processes, 7.0 with these): its controller reconciles once a
# second instead of ten times, metrics are exported every second, Ray's own metrics collection is
# off (its dashboard is off anyway). And its workers run at the ingress's priority: Ray starts them
# at nice 15, and a replica's engine is the work itself (behind nice 15, any other process on the
# machine, the ingress included, takes its cores first). Each is an environment variable: one set
# already wins.
QUIET_RAY = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_enable_metrics_collection": "0",
}


def require_ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError:
        raise ConfigError(f"--replicas runs replicas on Ray Serve, which is not installed: {EXTRA}") from None
    return ray


def replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica (not the request) is gone."""
    from ray import exceptions as rx

    return isinstance(exc, (rx.RayActorError, rx.ActorUnavailableError, rx.ObjectLostError, TimeoutError))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else text


def replica_config(config: RuntimeConfig) -> RuntimeConfig:
    from dataclasses import replace

    return replace(config, isolate=False, replicas="", ray_address="")


def init_ray(ray: Any, config: RuntimeConfig, most: int) -> None:
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if config.ray_address:
        host, sep, port = config.ray_address.rpartition(":")
        if sep and config.ray_address != "auto":  # Ray itself waits minutes for an address nobody answers
            try:
                socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5).close()
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"cannot reach the Ray cluster at --ray-address {config.ray_address}: {exc}"
                ) from None
        try:  # a cluster started with `ray start` or ray.init() wants the token Ray saved; a driver
            # that joins sends it only when told to (it was refused, and retried for a minute)
            from ray._private.authentication import authentication_token_setup as auth

            auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        except (ImportError, AttributeError):  # another Ray: its own rules
            pass
        try:
            ray.init(address=config.ray_address, **kwargs)
        except Exception as exc:
            raise ConfigError(
                f"cannot join the Ray cluster at --ray-address {config.ray_address}: {first_line(exc)}"
            ) from None
        return
    cpus = max(os.cpu_count() or 1, int(most * config.replica_cpus + 0.999))
    start_local_ray(ray, num_cpus=cpus, **kwargs)


def start_local_ray(ray: Any, **kwargs: Any) -> None:
    """``ray.init`` of a local instance every process of which listens on 127.0.0.1 only.

    Ray has no bind address of its own: each of its servers (GCS, raylet, object manager,
    workers' gRPC, the dashboard and runtime-env agents, the metrics exporters) binds
    loopback when the node's address is 127.0.0.1 and every interface otherwise, and
    ``ray.init`` replaces a loopback node address by the machine's network address unless
    it is told that no cluster is wanted (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read
    where ``ray._private.ray_constants`` sets ``ENABLE_RAY_CLUSTER``, once when Ray is
    imported: so it is set on the module too). An unauthenticated Ray accepts jobs, which
    is code execution for whoever reaches its ports; this instance is reached from this
    machine only. A cluster to join is given with ``--ray-address`` (its operator's binding)."""
    for name, value in QUIET_RAY.items():  # read by the processes Ray starts now
        os.environ.setdefault(name, value)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # another Ray: the environment variable alone
        pass
    ray.init(_node_ip_address="127.0.0.1", **kwargs)


def make_deployment(serve: Any, rep: Any, routers: Any, config: RuntimeConfig, lo: int, hi: int) -> Any:
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    scaling: dict[str, Any] = {"num_replicas": lo}
    if hi > lo:
        scaling = {
            "autoscaling_config": AutoscalingConfig(
                min_replicas=lo, max_replicas=hi, target_ongoing_requests=max(1, config.parallel)
            )
        }
    return serve.deployment(
        rep.ReplicaServer,
        name=DEPLOYMENT,
        max_ongoing_requests=max(1, config.parallel) + config.queue_size + 16,
        ray_actor_options={"num_cpus": config.replica_cpus},
        request_router_config=RequestRouterConfig(
            request_router_class=routers.ROUTER_CLASSES[config.replica_router],
        ),
        max_constructor_retry_count=1,  # a replica that cannot start its engine fails the start, with its error
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        # a replica Ray Serve stops waits this long at most for its ongoing calls; the ingress moves
        # its streams off with their KV first (``ReplicaSet._see_off``: well under a second a stream)
        graceful_shutdown_timeout_s=20.0,
        **scaling,
    )


def scale_to(ray: Any, app: str, n: int) -> None:
    """Ask Ray Serve for ``n`` replicas of the set deployed as ``app`` (its external scaler API:
    a fixed ``--replicas N`` deploys with it on). Ray stops a replica gracefully or starts one."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=DEPLOYMENT, app_name=app), n))


def deploy_failure(serve: Any, app: str) -> str:
    """The replicas' own error when they did not start (Ray Serve keeps it in the app's status)."""
    try:
        status = serve.status().applications[app]
    except Exception:
        return ""
    for deployment in status.deployments.values():
        if deployment.message:
            return first_line(Exception(deployment.message))
    return ""


def stop_app(serve: Any, ray: Any, app: str, started_ray: bool) -> None:
    try:
        serve.delete(app)
    except Exception as exc:  # Ray going away already
        log.warning("replicas_stop", error=first_line(exc))
    if started_ray:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
