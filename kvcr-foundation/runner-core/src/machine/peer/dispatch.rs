//! The peer protocol's entry and exit: enabling it, stamping and queueing
//! outgoing messages, counting refusals, and routing each incoming message
//! to the role that handles it.

use super::*;

impl Core {
    /// Enables the peer protocol.
    pub fn enable_peer(&mut self, config: PeerConfig) {
        self.peer = Some(PeerState::new(config));
    }

    pub(in crate::machine) fn send(&mut self, to: ControlEndpoint, body: Body) {
        let Some(peer) = self.peer.as_ref() else {
            return;
        };
        let message = Message {
            header: peer.header(),
            body,
        };
        self.actions.push_back(Action::Send { to, message });
    }

    pub(in crate::machine) fn refuse(&mut self) {
        if let Some(peer) = self.peer.as_mut() {
            peer.counters.refused += 1;
        }
    }

    /// One control message from a peer.
    pub fn handle_message(&mut self, now: u64, message: Message) {
        if self.peer.is_none() {
            return;
        }
        // A message is handled on a driver turn: measure the stall first, so a
        // request that queued up while this process was stopped is refused
        // rather than served with a fresh deadline.
        self.latch_stall(now);
        let Message { header, body } = message;
        if let Some(peer) = self.peer.as_mut()
            && !peer.config.allows(&header.sender_endpoint)
        {
            peer.counters.refused_peers += 1;
            return;
        }
        match body {
            Body::TargetMetadata {
                worker_address,
                regions,
                shared_memory,
                doorbell,
                device_regions,
            } => self.on_target_metadata(
                now,
                &header,
                worker_address,
                regions,
                shared_memory,
                doorbell,
                device_regions,
            ),
            Body::TargetMetadataAck {
                one_copy, device, ..
            } => self.on_metadata_ack(now, &header, one_copy, device),
            Body::StartWrite {
                op_handle,
                remaining_timeout_ms,
                source_incarnation,
                namespace,
                keys,
                destinations,
                lead_elements,
            } => self.on_start_write(
                now,
                &header,
                op_handle,
                remaining_timeout_ms,
                source_incarnation,
                namespace,
                &keys,
                &destinations,
                lead_elements,
            ),
            Body::WriteLeadLanded {
                op_handle,
                elements,
            } => self.on_lead_landed(&header, op_handle, elements),
            Body::WriteRefused { op_handle } => self.on_write_end(now, &header, op_handle, None),
            Body::WriteDone { op_handle, outcome } => {
                self.on_write_end(now, &header, op_handle, Some(outcome))
            }
            Body::WriteProbe {
                op_handle,
                source_incarnation,
            } => self.on_probe(&header, op_handle, source_incarnation),
            Body::WriteProbeAck {
                op_handle,
                terminal,
                dead_incarnation,
            } => self.on_probe_ack(now, &header, op_handle, terminal, dead_incarnation),
            // The driver checks route proofs itself (against the nonce it
            // sent to the advertised worker); one reaching the core is stray.
            Body::RouteProof { .. } => {}
        }
    }
}
