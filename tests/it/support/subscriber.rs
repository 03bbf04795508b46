//! An MQTT subscriber (rumqttc sync client) that records every delivery, and
//! reconnects and re-subscribes by itself when its connection drops.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rumqttc::{
    Client, Connection, Event, MqttOptions, Outgoing, Packet, QoS, RecvTimeoutError,
    SubscribeReasonCode,
};

use super::{unique_suffix, wait_for};

/// Not shorter: a short recv_timeout cancels connect attempts in progress.
const RECV_TIMEOUT: Duration = Duration::from_millis(500);
const ERROR_BACKOFF: Duration = Duration::from_millis(200);
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_PACKET: usize = 1024 * 1024;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub topic: String,
    pub payload: Vec<u8>,
    pub dup: bool,
    pub retain: bool,
    /// QoS of the delivery as received (0, 1 or 2).
    pub qos: u8,
}

impl Delivery {
    /// The payload parsed as JSON (panics if it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload).unwrap_or_else(|e| {
            panic!(
                "delivery on {} is not JSON ({e}): {}",
                self.topic,
                String::from_utf8_lossy(&self.payload)
            )
        })
    }
}

#[derive(Default)]
struct State {
    deliveries: Mutex<Vec<Delivery>>,
    /// A SUBACK (all filters granted) has been seen on the current connection.
    subscribed: AtomicBool,
    connacks: AtomicU64,
    last_error: Mutex<Option<String>>,
    stop: AtomicBool,
}

pub struct Subscriber {
    client: Client,
    client_id: String,
    filter: String,
    state: Arc<State>,
    thread: Option<JoinHandle<()>>,
}

impl Subscriber {
    /// Connect to mqtt://127.0.0.1:`port` with a unique client id and a clean
    /// session, subscribe `filter` at QoS 1 and return once the SUBACK has
    /// arrived (panics after ~10 s otherwise).
    pub fn start(port: u16, filter: &str) -> Subscriber {
        let client_id = format!("edgespool-test-sub-{}", unique_suffix());
        let mut options = MqttOptions::new(client_id.clone(), "127.0.0.1", port);
        options
            .set_clean_session(true)
            .set_keep_alive(Duration::from_secs(5))
            .set_max_packet_size(MAX_PACKET, MAX_PACKET);
        let (client, connection) = Client::new(options, 16);
        let state = Arc::new(State::default());
        let thread = {
            let client = client.clone();
            let state = Arc::clone(&state);
            let filter = filter.to_string();
            std::thread::Builder::new()
                .name(format!("subscriber-{client_id}"))
                .spawn(move || event_loop(connection, client, filter, state))
                .expect("spawn subscriber thread")
        };
        let sub = Subscriber {
            client,
            client_id,
            filter: filter.to_string(),
            state,
            thread: Some(thread),
        };
        if !sub.wait_subscribed(SUBSCRIBE_TIMEOUT) {
            panic!(
                "subscriber {} got no SUBACK for {:?} from 127.0.0.1:{port} within {:?} (last error: {})",
                sub.client_id,
                sub.filter,
                SUBSCRIBE_TIMEOUT,
                sub.last_error().unwrap_or_else(|| "none".into())
            );
        }
        sub
    }

    /// [`Subscriber::start`] on a board's events, `<prefix>/events/#`.
    pub fn events(port: u16, prefix: &str) -> Subscriber {
        Subscriber::start(port, &format!("{prefix}/events/#"))
    }

    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// True once a SUBACK has been seen on the current connection (the flag is
    /// cleared whenever the connection drops or a new CONNACK arrives).
    pub fn wait_subscribed(&self, timeout: Duration) -> bool {
        wait_for(timeout, || self.is_subscribed())
    }

    pub fn is_subscribed(&self) -> bool {
        self.state.subscribed.load(Ordering::SeqCst)
    }

    /// Number of CONNACKs received (1 after `start`, +1 per reconnect).
    pub fn connections(&self) -> u64 {
        self.state.connacks.load(Ordering::SeqCst)
    }

    /// The last connection error seen, if any.
    pub fn last_error(&self) -> Option<String> {
        self.state
            .last_error
            .lock()
            .expect("subscriber error lock")
            .clone()
    }

    /// A snapshot of every delivery so far, in arrival order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.state
            .deliveries
            .lock()
            .expect("subscriber deliveries lock")
            .clone()
    }

    /// The payloads of every delivery so far, in arrival order.
    pub fn payloads(&self) -> Vec<Vec<u8>> {
        self.deliveries().into_iter().map(|d| d.payload).collect()
    }

    pub fn count(&self) -> usize {
        self.state
            .deliveries
            .lock()
            .expect("subscriber deliveries lock")
            .len()
    }

    /// Forget the deliveries recorded so far.
    pub fn clear(&self) {
        self.state
            .deliveries
            .lock()
            .expect("subscriber deliveries lock")
            .clear();
    }

    /// Poll until `pred(&deliveries)` holds or `timeout` passes; returns the
    /// final result of `pred`.
    pub fn wait_until(&self, timeout: Duration, pred: impl Fn(&[Delivery]) -> bool) -> bool {
        wait_for(timeout, || {
            let deliveries = self
                .state
                .deliveries
                .lock()
                .expect("subscriber deliveries lock");
            pred(&deliveries)
        })
    }

    /// Wait until at least `n` deliveries have been recorded.
    pub fn wait_count(&self, timeout: Duration, n: usize) -> bool {
        self.wait_until(timeout, |d| d.len() >= n)
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = self.client.try_disconnect();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn event_loop(mut connection: Connection, client: Client, filter: String, state: Arc<State>) {
    let mut stop_deadline: Option<Instant> = None;
    loop {
        if state.stop.load(Ordering::SeqCst) {
            // Give the DISCONNECT queued by Drop a moment to go out.
            let deadline =
                *stop_deadline.get_or_insert_with(|| Instant::now() + Duration::from_secs(1));
            if Instant::now() >= deadline {
                break;
            }
        }
        match connection.recv_timeout(RECV_TIMEOUT) {
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
            Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                state.subscribed.store(false, Ordering::SeqCst);
                state.connacks.fetch_add(1, Ordering::SeqCst);
                if !state.stop.load(Ordering::SeqCst) {
                    // Clean session: subscriptions never survive a reconnect,
                    // and rumqttc does not re-subscribe on its own.
                    if let Err(e) = client.try_subscribe(filter.clone(), QoS::AtLeastOnce) {
                        *state.last_error.lock().expect("subscriber error lock") =
                            Some(format!("subscribe request failed: {e}"));
                    }
                }
            }
            Ok(Ok(Event::Incoming(Packet::SubAck(ack)))) => {
                let granted = ack
                    .return_codes
                    .iter()
                    .all(|c| matches!(c, SubscribeReasonCode::Success(_)));
                if granted {
                    state.subscribed.store(true, Ordering::SeqCst);
                } else {
                    *state.last_error.lock().expect("subscriber error lock") =
                        Some(format!("subscription refused: {:?}", ack.return_codes));
                }
            }
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                let delivery = Delivery {
                    topic: p.topic.clone(),
                    payload: p.payload.to_vec(),
                    dup: p.dup,
                    retain: p.retain,
                    qos: p.qos as u8,
                };
                state
                    .deliveries
                    .lock()
                    .expect("subscriber deliveries lock")
                    .push(delivery);
            }
            Ok(Ok(Event::Outgoing(Outgoing::Disconnect))) => {
                if state.stop.load(Ordering::SeqCst) {
                    break;
                }
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                state.subscribed.store(false, Ordering::SeqCst);
                *state.last_error.lock().expect("subscriber error lock") = Some(e.to_string());
                if state.stop.load(Ordering::SeqCst) {
                    break;
                }
                std::thread::sleep(ERROR_BACKOFF);
            }
        }
    }
}
