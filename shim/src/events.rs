//! The task events the shim publishes to containerd (`/tasks/create`, `start`, `exit`,
//! `delete`, `exec-added`, `exec-started`, `paused`, `resumed`): containerd's CRI plugin
//! learns from `/tasks/exit` that a container or a pod's sandbox ended.

use std::sync::OnceLock;

use containerd_shim::publisher::RemotePublisher;
use containerd_shim::Context;
use containerd_shim_protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskPaused, TaskResumed,
    TaskStart,
};
use containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim_protos::protobuf::{MessageDyn, MessageField};
use containerd_shim_protos::topics;

/// Where the shim's events go: containerd, once it has given its address.
pub struct Events {
    namespace: String,
    publisher: OnceLock<RemotePublisher>,
}

impl Events {
    /// Events of containers in `namespace`, published once [`Events::connect`] is called.
    pub fn new(namespace: &str) -> Self {
        Self {
            namespace: namespace.to_string(),
            publisher: OnceLock::new(),
        }
    }

    /// Publishes through `publisher` from now on.
    pub fn connect(&self, publisher: RemotePublisher) {
        let _ = self.publisher.set(publisher);
    }

    async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        let Some(p) = self.publisher.get() else {
            return;
        };
        let sent = p.publish(Context::default(), topic, &self.namespace, event);
        if let Err(e) = sent.await {
            log::warn!("publishing {topic}: {e}");
        }
    }

    pub async fn create(&self, id: &str, bundle: &str, pid: u32) {
        let event = TaskCreate {
            container_id: id.into(),
            bundle: bundle.into(),
            pid,
            ..Default::default()
        };
        self.publish(topics::TASK_CREATE_EVENT_TOPIC, Box::new(event))
            .await;
    }

    /// Process `exec_id` ("" for the container's own) of container `id` started.
    pub async fn start(&self, id: &str, exec_id: &str, pid: u32) {
        if exec_id.is_empty() {
            let event = TaskStart {
                container_id: id.into(),
                pid,
                ..Default::default()
            };
            self.publish(topics::TASK_START_EVENT_TOPIC, Box::new(event))
                .await;
        } else {
            let event = TaskExecStarted {
                container_id: id.into(),
                exec_id: exec_id.into(),
                pid,
                ..Default::default()
            };
            self.publish(topics::TASK_EXEC_STARTED_EVENT_TOPIC, Box::new(event))
                .await;
        }
    }

    pub async fn exec_added(&self, id: &str, exec_id: &str) {
        let event = TaskExecAdded {
            container_id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        };
        self.publish(topics::TASK_EXEC_ADDED_EVENT_TOPIC, Box::new(event))
            .await;
    }

    /// Process `exec_id` ("" for the container's own) of container `id` ended.
    pub async fn exit(&self, id: &str, exec_id: &str, pid: u32, status: u32, at: Timestamp) {
        let event = TaskExit {
            container_id: id.into(),
            id: if exec_id.is_empty() { id } else { exec_id }.into(),
            pid,
            exit_status: status,
            exited_at: MessageField::some(at),
            ..Default::default()
        };
        self.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(event))
            .await;
    }

    pub async fn delete(&self, id: &str, pid: u32, status: u32, at: Timestamp) {
        let event = TaskDelete {
            container_id: id.into(),
            id: id.into(),
            pid,
            exit_status: status,
            exited_at: MessageField::some(at),
            ..Default::default()
        };
        self.publish(topics::TASK_DELETE_EVENT_TOPIC, Box::new(event))
            .await;
    }

    pub async fn paused(&self, id: &str, paused: bool) {
        match paused {
            true => {
                let event = TaskPaused {
                    container_id: id.into(),
                    ..Default::default()
                };
                self.publish(topics::TASK_PAUSED_EVENT_TOPIC, Box::new(event))
                    .await
            }
            false => {
                let event = TaskResumed {
                    container_id: id.into(),
                    ..Default::default()
                };
                self.publish(topics::TASK_RESUMED_EVENT_TOPIC, Box::new(event))
                    .await
            }
        }
    }
}
