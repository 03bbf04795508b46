//! The command thread's receipt of a message: parsed (malformed ones
//! answered within the answers budget), judged (a duplicate, a conflict,
//! an answer now, or a claim), admitted against the tier's room and rate,
//! and claimed in one transaction before its PUBLISH is acknowledged.
//!
//! Its one rule, the thread's: **the PUBLISH of a command is acknowledged
//! only after its receipt (or its rejection) has committed**.

use super::*;

impl Worker {
    pub(super) fn handle(&mut self, msg: CmdMsg, spool: &mut Spool, ids: &mut EventIdGen) {
        match msg {
            CmdMsg::Wake => {}
            CmdMsg::Incoming {
                epoch,
                publish,
                tier,
            } => self.incoming(epoch, publish, tier, spool, ids),
            CmdMsg::Done {
                lane,
                scope,
                command_id,
                name,
                outcome,
                duration,
                retry_safe,
            } => {
                self.lanes[lane.index()].busy = false;
                let f = Finished::ran(scope, command_id, name, outcome, duration, retry_safe);
                self.finish(spool, ids, f);
            }
        }
    }

    /// Take a PUBLISH of connection `epoch`: answer it, claim its receipt,
    /// or hold it back. It is acknowledged only once that has committed.
    ///
    /// `judged` is its tier as the inbox judged it ([`admission::peek`]):
    /// [`Tier::Operator`] only when its signature verified there.
    pub(super) fn incoming(
        &mut self,
        epoch: u64,
        publish: rumqttc::Publish,
        judged: Tier,
        spool: &mut Spool,
        ids: &mut EventIdGen,
    ) {
        if publish.payload.is_empty() {
            self.retained_cleared(epoch, &publish, spool);
            return;
        }
        let cmd: Command = match parse(&publish.payload, self.cfg.commands.max_payload_bytes) {
            Ok(c) => c,
            Err(e) => {
                self.malformed(epoch, publish, &e, spool, ids);
                return;
            }
        };
        let route = self.route(&cmd.name);
        let signer = match (judged, cmd.signature) {
            (Tier::Operator, _) => Signer::Operator,
            (_, Some(_)) => Signer::Unknown,
            (_, None) => Signer::Unsigned,
        };
        let tier = Tier::of(&cmd.name, signer);
        let rate_now = self.started.elapsed();
        let verdict = match self.verdict(&cmd, route, (tier, signer), rate_now, spool) {
            Ok(v) => v,
            Err(why) => {
                self.held.park(epoch, publish, (Some(route), tier), why);
                return;
            }
        };
        if !self.may_answer(&cmd, tier, &verdict, rate_now, spool) {
            self.drop_unanswered(epoch, &publish);
            return;
        }
        let admission = self.admission(&cmd, route, tier, rate_now, verdict);
        let retained = publish.retain;
        if let Some(claim) = self.claim(epoch, publish, &cmd, &admission, spool, ids) {
            self.claimed(claim, cmd, &admission, retained);
        }
    }

    /// An empty message: the MQTT way to clear a retained command is an
    /// empty retained message, and subscribers connected at that moment get
    /// it with the retain flag cleared (MQTT 3.1.1 §3.3.1.3), so any empty
    /// payload is taken as a clear. Nothing to answer.
    pub(super) fn retained_cleared(
        &mut self,
        epoch: u64,
        publish: &rumqttc::Publish,
        spool: &mut Spool,
    ) {
        log::debug!(
            "commands: empty message on {} (retain={}): a retained command was cleared; ignored",
            publish.topic,
            publish.retain
        );
        if let Err(e) = spool.count("commands_retained_cleared", 1) {
            self.errors.log("counting a cleared retained command", &e);
        }
        self.link.ack(epoch, publish);
        self.inbox.release(publish);
    }

    /// A message that is no command: answered `rejected` (with the command
    /// id, when one could be read) and acknowledged once that committed.
    pub(super) fn malformed(
        &mut self,
        epoch: u64,
        publish: rumqttc::Publish,
        e: &ParseError,
        spool: &mut Spool,
        ids: &mut EventIdGen,
    ) {
        if let Some(why) = self.write_refusal() {
            self.held.park(epoch, publish, (None, Tier::Other), why);
            return;
        }
        if !self.budgets.answer(Tier::Other, self.started.elapsed()) {
            self.drop_unanswered(epoch, &publish);
            return;
        }
        self.malformed_log
            .warn(|| format!("commands: rejected message on {}: {e}", publish.topic));
        let mut ctx = self.ctx(ids);
        let res = store::reject_unparsed(
            spool,
            e.command_id(),
            &e.to_string(),
            &publish.payload,
            &mut ctx,
        );
        match res {
            Ok(()) => self.committed(epoch, &publish),
            Err(err) => {
                self.errors.log(
                    "recording a rejected command (kept, not acknowledged)",
                    &err,
                );
                self.write_failed();
                self.held.park(
                    epoch,
                    publish,
                    (None, Tier::Other),
                    format!("the spool refused a write: {err}"),
                );
            }
        }
    }

    /// Whether `cmd`, of `tier`, given `verdict`, may be answered at
    /// receipt: one accepted to run is (it was counted against its rate),
    /// unless it is a duplicate; every other answer takes a token from its
    /// tier's answer budget ([`Budgets::answer`]).
    pub(super) fn may_answer(
        &mut self,
        cmd: &Command,
        tier: Tier,
        verdict: &Verdict,
        now: Duration,
        spool: &mut Spool,
    ) -> bool {
        if matches!(verdict, Verdict::Accept)
            && !spool
                .command_exists(&cmd.scope, &cmd.command_id)
                .unwrap_or(true)
        {
            return true;
        }
        self.budgets.answer(tier, now)
    }

    /// A message over the answer budget: acknowledged, nothing written, and
    /// counted (in the spool within [`UNANSWERED_COUNT_EVERY`]).
    pub(super) fn drop_unanswered(&mut self, epoch: u64, publish: &rumqttc::Publish) {
        self.unanswered.0 += 1;
        self.unanswered_log.warn(|| {
            format!(
                "commands: more than {} answers per minute to commands no operator key signed \
                 (commands.max_answers_per_minute): a message on {} was acknowledged and dropped \
                 unanswered, nothing recorded (counted commands_unanswered)",
                self.cfg.commands.max_answers_per_minute, publish.topic
            )
        });
        self.link.ack(epoch, publish);
        self.last_ack = Some(Instant::now());
        self.inbox.release(publish);
    }

    /// Add the messages dropped unanswered to `commands_unanswered`, at most
    /// once per [`UNANSWERED_COUNT_EVERY`]: counting each would be the
    /// write the budget saves.
    pub(super) fn count_unanswered(&mut self, spool: &mut Spool) {
        let (n, last) = self.unanswered;
        if n == 0 || last.is_some_and(|t| t.elapsed() < UNANSWERED_COUNT_EVERY) {
            return;
        }
        match spool.count("commands_unanswered", i64::try_from(n).unwrap_or(i64::MAX)) {
            Ok(()) => self.unanswered = (0, Some(Instant::now())),
            Err(e) => {
                self.errors.log("counting unanswered commands", &e);
                self.unanswered.1 = Some(Instant::now());
            }
        }
    }

    /// What a new `cmd` of `tier`, signed by `signer`, running on `route`,
    /// gets at `now` (the rate limiter's time), in this order: over its
    /// rate, answered `rate_limited`; no room among the records, answered
    /// `no_room` (other commands, and those refused for want of a
    /// signature) or held back (`Err`); a side effect no operator key
    /// signed, refused (`unsigned`, [`admission::unsigned_refusal`]); its
    /// lane full or the spool refusing writes, held back; an unknown name,
    /// rejected; `ping` and `status`, answered now; the rest, accepted to
    /// run. A command already recorded gets its stored answer whatever this
    /// says ([`store::claim`]).
    pub(super) fn verdict(
        &mut self,
        cmd: &Command,
        route: Route,
        (tier, signer): (Tier, Signer),
        now: Duration,
        spool: &mut Spool,
    ) -> Result<Verdict, String> {
        let c = &self.cfg.commands;
        let unsigned = admission::unsigned_refusal(
            cmd,
            signer,
            route != Route::Unknown,
            c.allow_unsigned,
            c.operator_public_keys.len(),
        );
        let to_run = runs(route, cmd, unsigned.is_some());
        if let Some(why) = self.budgets.refusal(&cmd.scope, tier, to_run, now) {
            return Ok(Verdict::Refuse(why));
        }
        if (tier == Tier::Other || unsigned.is_some()) && self.records_full(tier, spool) {
            return Ok(Verdict::NoRoom(format!(
                "no room: {}; not recorded: send it again later",
                self.records_full_why(tier)
            )));
        }
        if let Some(why) = unsigned {
            return Ok(Verdict::Unsigned(why));
        }
        if let Some(why) = self.hold_reason(route, tier, spool) {
            return Err(why);
        }
        Ok(match route {
            Route::Unknown => Verdict::Reject(lanes::unknown_command(
                &cmd.name,
                &self.cfg.commands.handlers,
            )),
            _ if admission::side_effect_free(&cmd.name) => self.answer_now(cmd, spool),
            _ => Verdict::Accept,
        })
    }

    /// The answer of `cmd`, a built-in without a side effect, computed now
    /// (before its receipt: running it for a duplicate would change
    /// nothing). A command already recorded is left to [`store::claim`].
    pub(super) fn answer_now(&mut self, cmd: &Command, spool: &mut Spool) -> Verdict {
        match spool.command_exists(&cmd.scope, &cmd.command_id) {
            Ok(false) => {}
            Ok(true) => return Verdict::Accept,
            Err(e) => {
                self.errors.log("looking up a command record", &e);
                return Verdict::Accept;
            }
        }
        let t = Instant::now();
        let (state, result) = results::settle(builtin::run_local(&cmd.name, &cmd.args, spool));
        Verdict::Answer(Answered {
            state,
            result,
            duration_ms: i64::try_from(t.elapsed().as_millis()).unwrap_or(i64::MAX),
        })
    }

    /// How `cmd`, of `tier`, running on `route`, is received at `rate_now`.
    pub(super) fn admission(
        &mut self,
        cmd: &Command,
        route: Route,
        tier: Tier,
        rate_now: Duration,
        verdict: Verdict,
    ) -> Admission {
        // Exec handlers get a time to live when the command names none;
        // built-ins need none.
        let ttl = cmd.ttl.or(match route {
            Route::Lane(Lane::Exec) => Some(self.cfg.commands.default_ttl),
            _ => None,
        });
        let (now, trusted) = wall_clock_ms();
        let ttl_ms = ttl.map(|t| i64::try_from(t.as_millis()).unwrap_or(i64::MAX));
        let deadline_wall = ttl_ms
            .filter(|_| trusted)
            .map(|t| cmd.issued_at_ms.unwrap_or(now).saturating_add(t));
        // Judged against the time floor while the clock is untrusted.
        let deadline_issued = cmd
            .issued_at_ms
            .zip(ttl_ms)
            .map(|(at, t)| at.saturating_add(t));
        Admission {
            route,
            ttl,
            deadline_wall,
            deadline_issued,
            rate_now,
            tier,
            verdict,
        }
    }

    /// Commit the receipt of `cmd` (and its answer, if it is not to run),
    /// then acknowledge it. `None` when the spool refused: it is parked,
    /// not acknowledged, and tried again (or redelivered by the broker on
    /// the next session).
    pub(super) fn claim(
        &mut self,
        epoch: u64,
        publish: rumqttc::Publish,
        cmd: &Command,
        a: &Admission,
        spool: &mut Spool,
        ids: &mut EventIdGen,
    ) -> Option<Claim> {
        let clock_ms = self.records.now_ms();
        // Only a signature by an operator key moves the time floor.
        let floor = cmd
            .issued_at_ms
            .filter(|_| a.tier == Tier::Operator)
            .map(|at| Mark::of(at, clock_ms, synced_wall_ms()));
        let receipt = Receipt {
            deadline_ms: a.deadline_wall,
            ttl: a.ttl,
            clock_ms,
            admit: a.verdict.admit(),
            floor,
        };
        let mut ctx = self.ctx(ids);
        match store::claim(spool, cmd, publish.retain, &receipt, &mut ctx) {
            Ok(claim) => {
                if let (Some(m), Claim::New | Claim::Answered | Claim::Rejected) = (floor, &claim) {
                    self.floor.raise(m);
                }
                self.committed(epoch, &publish);
                Some(claim)
            }
            Err(e) => {
                self.errors
                    .log("claiming a command receipt (kept, not acknowledged)", &e);
                self.write_failed();
                self.held.park(
                    epoch,
                    publish,
                    (Some(a.route), a.tier),
                    format!("the spool refused a write: {e}"),
                );
                None
            }
        }
    }

    /// What a PUBLISH caused has committed: only now may the broker forget
    /// it.
    pub(super) fn committed(&mut self, epoch: u64, publish: &rumqttc::Publish) {
        self.write_retry = None;
        self.link.ack(epoch, publish);
        self.last_ack = Some(Instant::now());
        self.inbox.release(publish);
        let _ = self.to_delivery.send(DeliveryMsg::NewRows);
    }

    /// After the receipt of `cmd` committed as `claim`: a new command is
    /// counted against its scope's rate and queued; the rest is logged.
    pub(super) fn claimed(&mut self, claim: Claim, cmd: Command, a: &Admission, retained: bool) {
        match claim {
            Claim::New => {
                let to_run = runs(a.route, &cmd, false);
                self.budgets.take(&cmd.scope, a.tier, to_run, a.rate_now);
                self.records.added();
                log::info!(
                    "command {}/{} ({}) received",
                    cmd.scope,
                    cmd.command_id,
                    cmd.name
                );
                self.enqueue(Pending {
                    scope: cmd.scope,
                    command_id: cmd.command_id,
                    name: cmd.name,
                    args: cmd.args,
                    deadline_wall: a.deadline_wall,
                    deadline_issued: a.deadline_issued,
                    deadline_mono: a.ttl.map(|t| Instant::now() + t),
                    age_unknown: false,
                    tier: a.tier,
                });
            }
            Claim::Answered => {
                self.budgets.take(&cmd.scope, a.tier, false, a.rate_now);
                self.records.added();
                let state = match &a.verdict {
                    Verdict::Answer(x) => x.state,
                    _ => "answered",
                };
                log::info!(
                    "command {}/{} ({}) {state} at receipt",
                    cmd.scope,
                    cmd.command_id,
                    cmd.name
                );
            }
            Claim::Rejected => {
                self.budgets.take(&cmd.scope, a.tier, false, a.rate_now);
                self.records.added();
                self.rejected_log.warn(|| match &a.verdict {
                    Verdict::Unsigned(why) => format!(
                        "commands: {}/{} ({}) rejected: {why}",
                        cmd.scope, cmd.command_id, cmd.name
                    ),
                    _ => format!(
                        "commands: {}/{} rejected: unknown command {:?}",
                        cmd.scope, cmd.command_id, cmd.name
                    ),
                });
            }
            Claim::Refused => self.refused_log.warn(|| {
                let why = match &a.verdict {
                    Verdict::Refuse(why) => why.as_str(),
                    _ => "rate limit",
                };
                format!("commands: {}/{} refused: {why}", cmd.scope, cmd.command_id)
            }),
            Claim::NoRoom => self.no_room_log.warn(|| {
                let why = match &a.verdict {
                    Verdict::NoRoom(why) => why.as_str(),
                    _ => "no room",
                };
                format!("commands: {}/{} refused: {why}", cmd.scope, cmd.command_id)
            }),
            Claim::Duplicate { state } => log::info!(
                "command {}/{}: duplicate delivery{}; answered from the store ({state}), not run again",
                cmd.scope,
                cmd.command_id,
                if retained { " (retained)" } else { "" }
            ),
            Claim::InProgress => log::info!(
                "command {}/{}: duplicate while still running; answered in_progress",
                cmd.scope,
                cmd.command_id
            ),
            Claim::Conflict => log::warn!(
                "command {}/{}: same id, different request; answered conflict, original untouched",
                cmd.scope,
                cmd.command_id
            ),
        }
    }
}

/// The wall clock now, Unix ms, if it is past the floor and the kernel says
/// time sync vouches for it ([`crate::os::clock::kernel_sync`]).
fn synced_wall_ms() -> Option<i64> {
    let (now, trusted) = wall_clock_ms();
    let synced = matches!(
        crate::os::clock::kernel_sync(),
        crate::event::clock::Sync::Synchronized { .. }
    );
    (trusted && synced).then_some(now)
}
