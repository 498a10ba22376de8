"""Writes grafana/dashboards/*.json (run after changing a panel: python grafana/generate_dashboards.py).

The JSON files are what Grafana loads and what tests/test_metrics_prometheus.py
checks against a real Prometheus; this script only keeps them consistent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
RI = "$__rate_interval"


def target(expr: str, legend: str = "", ref: str = "A", fmt: str = "time_series") -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref, "format": fmt,
            "range": True}


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append({"type": "row", "title": title, "id": self.next_id, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.next_id += 1
        self.y += 1

    def panel(self, kind: str, title: str, description: str, targets: list[dict[str, Any]], *, unit: str = "short",
              w: int = 8, extra: dict[str, Any] | None = None) -> None:
        if self.x + w > 24:
            self.y += 8
            self.x = 0
        panel: dict[str, Any] = {
            "type": kind, "title": title, "description": description, "id": self.next_id, "datasource": DS,
            "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
            "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
        }
        if extra:
            panel.update(extra)
        self.panels.append(panel)
        self.next_id += 1
        self.x += w


def variables(extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    def query_var(name: str, label: str, query: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": query, "refId": f"{name}-values"}, "definition": query, "refresh": 2,
                "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}

    return {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {"selected": True, "text": "Prometheus (dniasync)", "value": "dniasync-prometheus"},
         "hide": 0, "refresh": 1, "regex": ""},
        query_var("job", "Job", "label_values(dniasync_build_info, job)"),
        query_var("instance", "Node", 'label_values(dniasync_build_info{job=~"$job"}, instance)'),
        *(extra or []),
    ]}


def dashboard(uid: str, title: str, description: str, layout: Layout, templating: dict[str, Any]) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["dniasync"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "5s", "time": {"from": "now-15m", "to": "now"},
        "timezone": "", "graphTooltip": 1, "panels": layout.panels, "templating": templating,
        "annotations": {"list": []}, "links": [],
    }


def overview() -> dict[str, Any]:
    d = Layout()
    d.row("Cluster")
    d.panel("stat", "Members up", "Nodes Prometheus scrapes successfully.",
            [target(f"sum(up{{{SEL}}})", "members up")], w=4)
    d.panel("bargauge", "Members up by role", "Nodes up per role (dniasync_node_info joined with up).",
            [target(f"sum by (role) (dniasync_node_info{{{SEL}}} * on (job, instance) group_left up{{{SEL}}})",
                    "{{role}}")], w=6)
    d.panel("timeseries", "Actor restarts", "Actors restarted by their supervisor, per node.",
            [target(f"sum by (instance) (increase(dniasync_actor_restarts_total{{{SEL}}}[{RI}]))", "{{instance}}")],
            w=7)
    d.panel("timeseries", "Peers and reconnects", "Peers each node is connected to; reconnects and peers lost.",
            [target(f"dniasync_remote_peers_up{{{SEL}}}", "up {{instance}}"),
             target(f"sum(increase(dniasync_remote_reconnects_total{{{SEL}}}[{RI}]))", "reconnects"),
             target(f"sum(increase(dniasync_remote_peers_lost_total{{{SEL}}}[{RI}]))", "peers lost")], w=7)
    d.row("Training")
    d.panel("timeseries", "Loss", "Held-out loss (coordinator) and recent training loss (replicas).",
            [target(f"dniasync_train_eval_loss{{{SEL}}}", "held-out"),
             target(f"dniasync_replica_loss{{{SEL}}}", "train {{instance}}")])
    d.panel("timeseries", "Held-out accuracy", "Accuracy on held-out data at each evaluation.",
            [target(f"dniasync_train_eval_accuracy_ratio{{{SEL}}}", "accuracy")], unit="percentunit",
            extra={"fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1}, "overrides": []}})
    d.panel("timeseries", "Samples/s per node", "Training throughput of each replica, and the cluster's.",
            [target(f"sum by (instance) (rate(dniasync_replica_samples_total{{{SEL}}}[{RI}]))", "{{instance}}"),
             target(f"sum(rate(dniasync_train_samples_total{{{SEL}}}[{RI}]))", "cluster")])
    d.panel("timeseries", "Steps/s per node", "Mini-batch steps per second of each replica.",
            [target(f"sum by (instance) (rate(dniasync_replica_steps_total{{{SEL}}}[{RI}]))", "{{instance}}")])
    d.panel("stat", "Epochs", "Epochs of training data processed so far.",
            [target(f"max(dniasync_train_epochs{{{SEL}}})", "epochs")], w=4)
    d.panel("stat", "Replicas alive", "Replicas the coordinator considers alive / declared dead.",
            [target(f"sum(dniasync_train_replicas_alive{{{SEL}}})", "alive"),
             target(f"sum(dniasync_train_replicas_dead{{{SEL}}})", "dead")], w=4)
    d.row("Sandblaster L-BFGS")
    d.panel("timeseries", "L-BFGS loss", "Full-batch training loss at Sandblaster's latest iterate.",
            [target(f"max(dniasync_sandblaster_train_loss{{{SEL}}})", "training loss")])
    d.panel("timeseries", "L-BFGS iterations and line search",
            "Iterations, full-batch gradients and line-search evaluations per second.",
            [target(f"sum(rate(dniasync_sandblaster_iterations_total{{{SEL}}}[{RI}]))", "iterations"),
             target(f"sum(rate(dniasync_sandblaster_batch_gradients_total{{{SEL}}}[{RI}]))", "batch gradients"),
             target(f"sum(rate(dniasync_sandblaster_line_search_evaluations_total{{{SEL}}}[{RI}]))",
                    "line-search evaluations")], unit="ops")
    d.panel("stat", "Portions reissued", "Portions handed out again (backup tasks, a lost replica's), backup "
            "tasks, and duplicate results dropped, since the start.",
            [target(f"sum(dniasync_sandblaster_portions_reissued_total{{{SEL}}})", "reissued"),
             target(f"sum(dniasync_sandblaster_backup_tasks_total{{{SEL}}})", "backup tasks"),
             target(f"sum(dniasync_sandblaster_duplicates_dropped_total{{{SEL}}})", "duplicates dropped")], w=4)
    d.panel("stat", "Coordinator bytes per iteration", "Bytes of commands and scalar replies between the "
            "coordinator and the PS shards per L-BFGS iteration (no parameter vector passes through it).",
            [target(f"sum(dniasync_sandblaster_command_bytes_total{{{SEL}}}) / "
                    f"clamp_min(sum(dniasync_sandblaster_iterations_total{{{SEL}}}), 1)", "bytes/iteration")],
            unit="decbytes", w=4)
    d.row("Peer to peer")
    d.panel("timeseries", "P2P bytes/s per peer", "Payload bytes of peer-to-peer updates and dense copies each "
            "peer sends and receives per second.",
            [target(f"sum by (instance) (rate(dniasync_p2p_bytes_total{{{SEL}, direction=\"sent\"}}[{RI}]))",
                    "sent {{instance}}"),
             target(f"sum by (instance) (rate(dniasync_p2p_bytes_total{{{SEL}, direction=\"received\"}}[{RI}]))",
                    "received {{instance}}")], unit="Bps", w=6)
    d.panel("timeseries", "P2P updates/s", "Updates each peer applies to its shared copy per second (its own and "
            "its peers'), and the updates sent, received and received again across the job.",
            [target(f"sum by (instance) (rate(dniasync_p2p_updates_total{{{SEL}, event=\"applied\"}}[{RI}]))",
                    "applied {{instance}}"),
             target(f"sum by (event) (rate(dniasync_p2p_updates_total{{{SEL}, "
                    f"event=~\"sent|received|duplicate\"}}[{RI}]))", "{{event}}")], unit="ops", w=6)
    d.panel("timeseries", "P2P peers alive and lag", "Peers in each peer's view of the membership (itself "
            "included), peers the coordinator considers alive, and the most updates a peer's shared copy lacks.",
            [target(f"dniasync_p2p_peers_alive{{{SEL}}}", "view of {{instance}}"),
             target(f"max(dniasync_p2p_job_peers_alive{{{SEL}}})", "coordinator"),
             target(f"max(dniasync_p2p_lag_updates{{{SEL}}})", "max lag (updates)")], w=6)
    d.panel("timeseries", "P2P consensus distance", "Max and mean over the live peers of |w_i - mean w| / |mean w| "
            "at each evaluation (count-sketch estimate): how far the peers' shared copies drift apart.",
            [target(f"max(dniasync_p2p_consensus_distance_ratio{{{SEL}, stat=\"max\"}})", "max"),
             target(f"max(dniasync_p2p_consensus_distance_ratio{{{SEL}, stat=\"mean\"}})", "mean")],
            unit="percentunit", w=6)
    d.row("Async health")
    d.panel("heatmap", "Staleness heatmap", "PS version gap of each push (versions), per interval.",
            [target(f"sum by (le) (increase(dniasync_ps_staleness_versions_bucket{{{SEL}}}[{RI}]))", "{{le}}",
                    fmt="heatmap")], unit="short",
            extra={"options": {"calculate": False, "yAxis": {"axisLabel": "staleness"},
                               "cellGap": 1, "color": {"scheme": "Oranges", "mode": "scheme"}}})
    d.panel("timeseries", "Staleness quantiles", "Median and 99th percentile staleness of pushes.",
            [target(f"histogram_quantile(0.5, sum by (le) (rate(dniasync_ps_staleness_versions_bucket{{{SEL}}}[{RI}])))",
                    "p50"),
             target(f"histogram_quantile(0.99, sum by (le) (rate(dniasync_ps_staleness_versions_bucket{{{SEL}}}[{RI}])))",
                    "p99"),
             target(f"sum(rate(dniasync_ps_staleness_versions_sum{{{SEL}}}[{RI}])) / "
                    f"sum(rate(dniasync_ps_staleness_versions_count{{{SEL}}}[{RI}]))", "mean")])
    d.panel("timeseries", "Rejected updates", "Pushes a PS shard refused, by reason.",
            [target(f"sum by (reason) (rate(dniasync_ps_updates_rejected_total{{{SEL}}}[{RI}]))", "{{reason}}")],
            unit="ops")
    d.panel("timeseries", "PS update rate", "Pushes applied per second, per shard.",
            [target(f"sum by (shard) (rate(dniasync_ps_updates_applied_total{{{SEL}}}[{RI}]))", "shard {{shard}}")],
            unit="ops")
    d.panel("timeseries", "PS versions", "Parameter version of each shard.",
            [target(f"max by (shard) (dniasync_ps_version{{{SEL}}})", "shard {{shard}}")])
    d.panel("timeseries", "Mailbox depth", "Messages queued on each node (all mailboxes, and the fullest).",
            [target(f"dniasync_actor_mailbox_messages{{{SEL}}}", "all {{instance}}"),
             target(f"dniasync_actor_mailbox_max_messages{{{SEL}}}", "fullest {{instance}}")])
    d.row("PS chains and coordinator")
    d.panel("timeseries", "PS chain length", "Copies in the chain of each replicated PS shard ([downpour] "
            "ps_replicas > 1), as the coordinator names it: a copy that dies is cut out within the detection "
            "interval, a restarted one joins at the tail.",
            [target(f"max by (shard) (dniasync_ps_chain_length{{{SEL}}})", "shard {{shard}}")])
    d.panel("timeseries", "PS chain views and changes", "View number of each shard's chain (one more per change) "
            "and the chain changes per interval.",
            [target(f"max by (shard) (dniasync_ps_chain_view{{{SEL}}})", "view shard {{shard}}"),
             target(f"sum(increase(dniasync_ps_chain_changes_total{{{SEL}}}[{RI}]))", "changes")])
    d.panel("stat", "Coordinator epoch", "Epoch of each node running a job as its coordinator: 1, one more each "
            "time a standby coordinator took the job over (the highest is the active one).",
            [target(f"dniasync_coordinator_epoch{{{SEL}}}", "{{instance}}")])
    d.row("Communication")
    d.panel("timeseries", "Bytes/s", "Websocket traffic of each node, per direction.",
            [target(f"sum by (instance, direction) (rate(dniasync_remote_bytes_total{{{SEL}}}[{RI}]))",
                    "{{instance}} {{direction}}")], unit="Bps")
    d.panel("timeseries", "Gradient and parameter bytes/s", "Payload pushed (gradients) and pulled (parameters).",
            [target(f"sum by (direction) (rate(dniasync_replica_bytes_total{{{SEL}}}[{RI}]))", "{{direction}}")],
            unit="Bps")
    d.panel("timeseries", "Compression ratio", "Dense float32 gradient bytes per byte pushed.",
            [target(f"sum(rate(dniasync_replica_push_dense_bytes_total{{{SEL}}}[{RI}])) / "
                    f"sum(rate(dniasync_replica_bytes_total{{{SEL}, direction=\"push\"}}[{RI}]))", "ratio"),
             target(f"dniasync_replica_compression_ratio{{{SEL}}}", "since start {{instance}}")])
    d.panel("timeseries", "Ask latency", "Round trip of remote asks by message type (p50, p99).",
            [target(f"histogram_quantile(0.5, sum by (le, msg_type) "
                    f"(rate(dniasync_remote_ask_duration_seconds_bucket{{{SEL}}}[{RI}])))", "p50 {{msg_type}}"),
             target(f"histogram_quantile(0.99, sum by (le, msg_type) "
                    f"(rate(dniasync_remote_ask_duration_seconds_bucket{{{SEL}}}[{RI}])))", "p99 {{msg_type}}")],
            unit="s")
    d.panel("timeseries", "Pushes and pulls", "Gradient pushes and parameter pulls per second.",
            [target(f"sum(rate(dniasync_replica_pushes_total{{{SEL}}}[{RI}]))", "pushes"),
             target(f"sum(rate(dniasync_replica_pulls_total{{{SEL}}}[{RI}]))", "pulls (replicas)"),
             target(f"sum by (shard) (rate(dniasync_ps_pulls_total{{{SEL}}}[{RI}]))", "pulls shard {{shard}}")],
            unit="ops")
    d.panel("timeseries", "Wire errors", "Decode errors, auth failures and dropped tells per second.",
            [target(f"sum(rate(dniasync_remote_decode_errors_total{{{SEL}}}[{RI}]))", "decode errors"),
             target(f"sum(rate(dniasync_remote_auth_failures_total{{{SEL}}}[{RI}]))", "auth failures"),
             target(f"sum(rate(dniasync_remote_dropped_tells_total{{{SEL}}}[{RI}]))", "dropped tells")],
            unit="ops")
    d.panel("table", "Versions", "What each node runs.",
            [target(f"dniasync_build_info{{{SEL}}}", fmt="table")], w=24,
            extra={"options": {"showHeader": True}})
    return dashboard("dniasync-overview", "dniasync / overview",
                     "Cluster membership, training progress, asynchrony and communication of a dniasync job.",
                     d, variables())


def model_parallel() -> dict[str, Any]:
    ssel = SEL + ', stage=~"$stage"'
    d = Layout()
    d.row("Pipeline stages")
    d.panel("timeseries", "Step time per stage", "Mean seconds a stage spends on one forward message.",
            [target(f"sum by (stage) (rate(dniasync_stage_step_seconds_sum{{{ssel}}}[{RI}])) / "
                    f"sum by (stage) (rate(dniasync_stage_step_seconds_count{{{ssel}}}[{RI}]))", "{{stage}}")],
            unit="s", w=12)
    d.panel("timeseries", "Busy fraction per stage", "Seconds of forward work per second (1 = never idle).",
            [target(f"sum by (stage) (rate(dniasync_stage_step_seconds_sum{{{ssel}}}[{RI}]))", "{{stage}}")],
            unit="percentunit", w=12)
    d.panel("timeseries", "Synthetic-gradient loss", "Latest regression loss of each stage's SG model.",
            [target(f"max by (stage) (dniasync_dni_sg_loss{{{ssel}}})", "{{stage}}")], w=12)
    d.panel("timeseries", "SG staleness", "Mean updates a stage made between a batch's forward and the SG fit on "
            "its true gradient (the delay the synthetic-gradient model learns across).",
            [target(f"sum by (stage) (rate(dniasync_dni_sg_staleness_updates_sum{{{ssel}}}[{RI}])) / "
                    f"sum by (stage) (rate(dniasync_dni_sg_staleness_updates_count{{{ssel}}}[{RI}]))", "{{stage}}")],
            w=12)
    d.panel("timeseries", "Queue depth", "Messages waiting in each stage's mailbox.",
            [target(f"max by (stage) (dniasync_stage_queue_messages{{{ssel}}})", "{{stage}}")], w=12)
    d.panel("timeseries", "Steps/s", "Optimizer steps per second of each stage and of its SG model.",
            [target(f"sum by (stage) (rate(dniasync_stage_steps_total{{{ssel}}}[{RI}]))", "{{stage}}"),
             target(f"sum by (stage) (rate(dniasync_dni_sg_steps_total{{{ssel}}}[{RI}]))", "SG {{stage}}")],
            unit="ops", w=12)
    d.panel("timeseries", "Evictions and late gradients", "Batches evicted before their gradient returned.",
            [target(f"sum by (stage) (rate(dniasync_stage_evictions_total{{{ssel}}}[{RI}]))", "evicted {{stage}}"),
             target(f"sum by (stage) (rate(dniasync_stage_late_gradients_total{{{ssel}}}[{RI}]))",
                    "late {{stage}}")], unit="ops", w=12)
    d.panel("timeseries", "Version gap per stage", "Updates a stage made between a batch's forward and the return of "
            "its true gradient (async, stash, spectrain: the version gap; dni, cdni: the SG fit's staleness).",
            [target(f"sum by (stage) (rate(dniasync_stage_version_gap_updates_sum{{{ssel}}}[{RI}])) / "
                    f"sum by (stage) (rate(dniasync_stage_version_gap_updates_count{{{ssel}}}[{RI}]))",
                    "{{stage}}")], w=12)
    d.panel("timeseries", "Stash bytes per stage", "Bytes of weight versions a stage holds for batches in flight "
            "(PipeDream weight stashing; 0 for other rules).",
            [target(f"max by (stage) (dniasync_stage_stash_bytes{{{ssel}}})", "{{stage}}")], unit="bytes", w=12)
    d.panel("timeseries", "Prediction error per stage (relative)", "What a stage steps on instead of the truth, "
            "relative: SpecTrain |W_predicted - W| / |W_forward - W| (below 1: the prediction beats no prediction); "
            "dni/cdni |M - g| / |g| of the SG model (above 1: worse than a zero gradient; the synthetic step's lr is "
            "then scaled down).",
            [target(f"max by (stage) (dniasync_stage_estimate_error_ratio{{{ssel}}})", "{{stage}}")], w=12)
    d.panel("timeseries", "Compute time per batch per stage", "Forward plus backward seconds a stage spends in its "
            "own layers per trained batch: what regrouping balances (the slowest stage sets the pipeline's pace).",
            [target(f"sum by (stage) (rate(dniasync_stage_compute_seconds_sum{{{ssel}}}[{RI}])) / "
                    f"sum by (stage) (rate(dniasync_stage_compute_seconds_count{{{ssel}}}[{RI}]))", "{{stage}}")],
            unit="s", w=12)
    d.panel("timeseries", "Layers per stage and layer moves", "Layers each stage holds now, and layers it gave away "
            "or took in regrouping moves.",
            [target(f"max by (stage) (dniasync_stage_layers{{{ssel}}})", "{{stage}} layers"),
             target(f"sum by (stage, direction) (increase(dniasync_stage_layer_moves_total{{{ssel}}}[{RI}]))",
                    "{{stage}} moved {{direction}}")], w=12)
    stage_var = {"name": "stage", "label": "Stage", "type": "query", "datasource": DS,
                 "query": {"query": 'label_values(dniasync_stage_steps_total{job=~"$job", instance=~"$instance"}, stage)',
                           "refId": "stage-values"},
                 "definition": 'label_values(dniasync_stage_steps_total{job=~"$job", instance=~"$instance"}, stage)',
                 "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
                 "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}
    return dashboard("dniasync-model-parallel", "dniasync / model parallel",
                     "Pipeline stages: step time, version gap, synthetic-gradient loss and queue depth per stage.",
                     d, variables([stage_var]))


def main() -> None:
    out = Path(__file__).resolve().parent / "dashboards"
    for name, board in (("dniasync-overview.json", overview()), ("dniasync-model-parallel.json", model_parallel())):
        (out / name).write_text(json.dumps(board, indent=2) + "\n")
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
