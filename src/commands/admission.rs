//! Who gets room: the operator's reserved share of every bound a command
//! can fill, and the global budgets no invented scope escapes.
//!
//! Its one rule: **a sender on the command topic cannot take the room the
//! operator's commands need**, and the operator is a key, not a name
//! (docs/invariants.md, "Trust boundaries"). Every command falls in one [`Tier`]:
//!
//! - [`Tier::Operator`]: signed by one of `commands.operator_public_keys`
//!   ([`super::signed`]: the board's own config lists them; nothing a
//!   command or a result says can make another sender one);
//! - [`Tier::Push`]: `apply-config` not so signed (a push is judged by its
//!   own policy: `[commands.config_push]`, overlay bounds, signatures);
//! - [`Tier::Other`]: everything else.
//!
//! What an unsigned command may do at all ([`unsigned_refusal`]): `ping`
//! and `status` ([`SIDE_EFFECT_FREE`]) are open to anyone; so is a signed
//! whole config (`apply-config` with `args.signature`: the push policy
//! checks that signature). Any other command has a side effect and runs
//! unsigned only with `commands.allow_unsigned = true`; otherwise it is
//! answered `rejected` (`unsigned: ...`) at receipt, within the answers
//! budget, its record droppable like every `rejected` one. A command whose
//! signature verifies with no listed key is refused the same way, whatever
//! its name and whatever `allow_unsigned` says: it is a forgery, a replay
//! moved to another board, scope or id, or a key the board no longer
//! lists, and saying so beats running it as a stranger's.
//!
//! Each bound `n` (command records, `commands.max_records`; commands
//! waiting per lane, `commands.max_queued`) is filled up to [`Tier::cap`]:
//! other commands to `n - n/4`, pushes to `n - n/8`, operator commands to
//! `n`. A quarter of every bound is therefore kept for the operator, half
//! of it open to pushes too. The count compared is the bound's whole fill
//! (all tiers), so whatever the others hold, the operator finds at least
//! `n/8` free. The command inbox keeps its bytes for other commands and
//! adds the reserve on top ([`Tier::headroom`]: a third more for operator
//! commands, a sixth for pushes).
//!
//! Rates ([`Budgets`]): every new command takes a token from its scope
//! (`commands.max_per_minute_per_scope`). One that is to *run* (not an
//! unknown name, not `ping` or `status`, whose records are droppable) of
//! another tier takes one from a budget shared by all such commands
//! (`commands.max_per_minute`) as well, so inventing scopes buys nothing; a
//! push from a budget of `max_per_minute_per_scope` per minute shared by
//! every push. Operator commands have buckets of their own per scope, kept
//! apart (invented scopes never push them into the shared overflow
//! bucket), and no global budget. A command over its rate is answered
//! `rate_limited`, not recorded.
//!
//! Answers: every answer is a spool commit (its record, its result event),
//! so what other senders can make the board write is bounded too. A
//! message of another tier answered at receipt (anything not accepted to
//! run: `ping`, `status`, unknown names, unsigned commands refused,
//! malformed messages, duplicates, `rate_limited` and `no_room` answers)
//! takes a token from a budget all of them share
//! (`commands.max_answers_per_minute`); one from a push from a budget of
//! `max_per_minute_per_scope` shared by every push. With none left the
//! message is acknowledged and dropped unanswered: nothing is recorded, it
//! is counted (`commands_unanswered`), and a sender that wants an answer
//! sends it again later. Operator commands spend neither.
//!
//! Records: `ping` and `status` ([`SIDE_EFFECT_FREE`]) are answered at
//! receipt, their record written already finished in the same transaction,
//! and such records are *droppable*, like `rejected` ones: nothing ran, so
//! deleting them cannot let anything run twice. When records reach a
//! tier's cap, droppable records go first, oldest first (the newest 100
//! stay), down to a tenth below the cap ([`super::retention::evict`]); a
//! record of a command that ran with a side effect (every other built-in,
//! every exec handler; `failed`, `expired` and `interrupted` ones too) is
//! never deleted inside the redelivery window (I4). If nothing can go, a
//! new command of another tier is answered `no_room` (not recorded: send it
//! again later), and an operator command or a push is held back
//! (unacknowledged) until there is room: that can only happen once the
//! operator's own commands (or pushes) have filled the reserve. Unsigned,
//! a sender can only leave droppable records, so by default nobody but the
//! operator can fill the records at all.
//!
//! Order: the command thread takes operator commands first, then pushes,
//! then the rest, whatever order they arrived in; in a lane's queue
//! operator commands wait ahead of pushes, pushes ahead of the rest.
//!
//! What a sender on the command topic without an operator key can and
//! cannot do:
//! - it can have `ping`, `status` and unknown names answered, offer signed
//!   whole configs (which the push policy verifies), spend the shared
//!   budgets, and, only where `commands.allow_unsigned = true`, run what
//!   the board's config lets any command run and fill the other tiers'
//!   share of records with commands that ran;
//! - it cannot fill the operator's share of records, lanes or the inbox,
//!   spend the operator's rate, have its commands handled before an
//!   operator command, get a command that ran with a side effect run twice,
//!   or become the operator by naming a scope; its answers, though, are
//!   events of the `_commands` stream like the operator's, delivered in
//!   order: the operator's answer follows the answers to what was handled
//!   before it;
//! - it can claim a (scope, command id) the operator will use, if it can
//!   guess it, so that the operator's signed command meets a record of
//!   another request (`conflict`): operators use ids nobody can guess (a
//!   random UUID).

use super::rate::{Budget, RateLimiter};
use super::signed::{OperatorKeys, Signer};
use serde::Deserialize;
use std::borrow::Cow;
use std::time::Duration;

/// Built-ins without a side effect: answered at receipt, their records
/// droppable at once.
pub const SIDE_EFFECT_FREE: &[&str] = &["ping", "status"];

/// Whether `name` is a built-in without a side effect.
pub fn side_effect_free(name: &str) -> bool {
    SIDE_EFFECT_FREE.contains(&name)
}

/// A command's share of the bounds, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Any other command.
    Other,
    /// `apply-config` not signed by an operator key.
    Push,
    /// A command signed by one of `commands.operator_public_keys`.
    Operator,
}

impl Tier {
    /// The tier of a command named `name`, signed by `signer`.
    pub fn of(name: &str, signer: Signer) -> Tier {
        if signer == Signer::Operator {
            Tier::Operator
        } else if name == "apply-config" {
            Tier::Push
        } else {
            Tier::Other
        }
    }

    /// How much of a bound of `n` this tier may fill: other commands
    /// `n - n/4`, pushes `n - n/8`, operator commands `n`.
    pub fn cap(self, n: usize) -> usize {
        match self {
            Tier::Other => n - n / 4,
            Tier::Push => n - n / 8,
            Tier::Operator => n,
        }
    }

    /// How much of a bound whose other commands' share is `n` this tier may
    /// fill, the reserve on top: other commands `n`, pushes `n + n/6`,
    /// operator commands `n + n/3` (the same quarter and eighth of the
    /// whole as [`Tier::cap`]). For the command inbox, whose bytes for
    /// other commands were bounded before tiers existed.
    pub fn headroom(self, n: usize) -> usize {
        match self {
            Tier::Other => n,
            Tier::Push => n + n / 6,
            Tier::Operator => n + n / 3,
        }
    }

    /// Position in the command thread's order: 0 is taken first.
    pub fn rank(self) -> usize {
        match self {
            Tier::Operator => 0,
            Tier::Push => 1,
            Tier::Other => 2,
        }
    }

    /// Name in log lines and refusals.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Other => "other",
            Tier::Push => "push",
            Tier::Operator => "operator",
        }
    }
}

/// The tier of a command message, judged before the command thread takes
/// it (the MQTT thread's inbox does this): [`Tier::Operator`] only when it
/// parses (within `max_bytes`) and its signature verifies with one of
/// `keys`; otherwise read from its `name` alone, and a message that is no
/// JSON object with a string `name` is [`Tier::Other`]. Unsigned messages,
/// and any message when no key is listed, cost no signature check.
pub fn peek(payload: &[u8], max_bytes: usize, keys: &OperatorKeys) -> Tier {
    #[derive(Deserialize)]
    struct Peek<'a> {
        #[serde(borrow, default)]
        name: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        signature: Option<Cow<'a, str>>,
    }
    // serde reads a struct from an array too: only an object is a command.
    let object = payload
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'{');
    if !object {
        return Tier::Other;
    }
    let Ok(p) = serde_json::from_slice::<Peek<'_>>(payload) else {
        return Tier::Other;
    };
    let name = p.name.as_deref().unwrap_or("");
    if p.signature.is_none() || keys.is_empty() {
        return Tier::of(name, Signer::Unsigned);
    }
    match super::parse(payload, max_bytes) {
        Ok(cmd) => Tier::of(&cmd.name, keys.signer(&cmd)),
        Err(_) => Tier::Other,
    }
}

/// Why an unsigned command, or one signed by no listed key (`signer`),
/// may not be taken, if it may not: it has a side effect (not `ping` or
/// `status`, not a signed whole config) and `allow_unsigned` is off, or it
/// carries a signature that verifies with none of the `keys` listed. The
/// answer starts `unsigned: ` and says what to do. `None` for an operator
/// command and for whatever is open to anyone. `known` is false for a name
/// no built-in or handler has (rejected as unknown instead).
pub fn unsigned_refusal(
    cmd: &super::Command,
    signer: Signer,
    known: bool,
    allow_unsigned: bool,
    keys: usize,
) -> Option<String> {
    match signer {
        Signer::Operator => None,
        Signer::Unknown => Some(format!(
            "unsigned: its signature verifies with none of the {keys} keys in \
             commands.operator_public_keys for this board, scope, command id, deadline and \
             request (a key not listed, or a command signed for another board or id); not run"
        )),
        Signer::Unsigned if allow_unsigned || !known || side_effect_free(&cmd.name) => None,
        Signer::Unsigned if cmd.name == "apply-config" && cmd.args.contains_key("signature") => {
            // A signed whole config: the push policy verifies its signature.
            None
        }
        Signer::Unsigned => Some(format!(
            "unsigned: {:?} has a side effect and this board runs such commands only when \
             signed by a key in commands.operator_public_keys ({keys} listed); sign it \
             (docs/commands.md, \"Signed commands\") or set commands.allow_unsigned = true in \
             the board's config; not run",
            cmd.name
        )),
    }
}

/// The rate budgets of new commands, by tier. Time is passed in (a
/// monotonic offset).
#[derive(Debug)]
pub struct Budgets {
    per_scope: u32,
    per_minute: u32,
    /// Per scope, commands that are not the operator's.
    scopes: RateLimiter,
    /// Per scope, the operator's (signed) commands only.
    operator: RateLimiter,
    /// Shared by every new [`Tier::Other`] command.
    others: Budget,
    /// Shared by every new [`Tier::Push`] command.
    pushes: Budget,
    /// Answers at receipt to [`Tier::Other`] messages.
    answers: Budget,
    /// Answers at receipt to [`Tier::Push`] messages.
    push_answers: Budget,
}

impl Budgets {
    /// `per_scope` new commands per scope and minute; `per_minute` for all
    /// [`Tier::Other`] commands together; `per_scope` for all pushes
    /// together; `answers_per_minute` answers at receipt to all
    /// [`Tier::Other`] messages together, `per_scope` to all pushes.
    pub fn new(per_scope: u32, per_minute: u32, answers_per_minute: u32) -> Budgets {
        Budgets {
            per_scope,
            per_minute,
            scopes: RateLimiter::new(per_scope),
            operator: RateLimiter::new(per_scope),
            others: Budget::new(per_minute),
            pushes: Budget::new(per_scope),
            answers: Budget::new(answers_per_minute),
            push_answers: Budget::new(per_scope),
        }
    }

    /// Take a token for an answer at receipt to a message of `tier` at
    /// `now`; false when its budget is spent (the message is then dropped
    /// unanswered). Operator messages always get one.
    pub fn answer(&mut self, tier: Tier, now: Duration) -> bool {
        let budget = match tier {
            Tier::Operator => return true,
            Tier::Push => &mut self.push_answers,
            Tier::Other => &mut self.answers,
        };
        if !budget.allows(now) {
            return false;
        }
        budget.take(now);
        true
    }

    /// Why a new command of `tier` in `scope`, that is to run (`runs`) or
    /// not, is over its rate at `now`, if it is (nothing is taken: see
    /// [`Budgets::take`]).
    pub fn refusal(
        &mut self,
        scope: &str,
        tier: Tier,
        runs: bool,
        now: Duration,
    ) -> Option<String> {
        let own = match tier {
            Tier::Operator => self.operator.allows(scope, now),
            Tier::Push | Tier::Other => self.scopes.allows(scope, now),
        };
        if !own {
            return Some(format!(
                "rate limit: more than {} new commands per minute in scope {scope:?} \
                 (commands.max_per_minute_per_scope); not recorded: send it again later",
                self.per_scope
            ));
        }
        match tier {
            _ if !runs => None,
            Tier::Other if !self.others.allows(now) => Some(format!(
                "rate limit: more than {} new commands per minute that are not signed by an \
                 operator key (commands.max_per_minute); not recorded: send it again later",
                self.per_minute
            )),
            Tier::Push if !self.pushes.allows(now) => Some(format!(
                "rate limit: more than {} apply-config commands per minute that are not \
                 signed by an operator key (commands.max_per_minute_per_scope); not recorded: \
                 send it again later",
                self.per_scope
            )),
            _ => None,
        }
    }

    /// Take the tokens of a new command of `tier` in `scope`, that is to
    /// run (`runs`) or not, at `now`.
    pub fn take(&mut self, scope: &str, tier: Tier, runs: bool, now: Duration) {
        match tier {
            Tier::Operator => self.operator.take(scope, now),
            Tier::Push | Tier::Other => self.scopes.take(scope, now),
        }
        match tier {
            Tier::Push if runs => self.pushes.take(now),
            Tier::Other if runs => self.others.take(now),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::event::signature::SigningKey;
    use serde_json::json;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    fn key() -> SigningKey {
        SigningKey::generate().expect("keygen").0
    }

    fn bytes(v: &serde_json::Value) -> Vec<u8> {
        v.to_string().into_bytes()
    }

    fn command(v: &serde_json::Value) -> super::super::Command {
        super::super::parse(&bytes(v), 65536).expect("a command")
    }

    #[test]
    fn the_tier_comes_from_the_signer_and_the_name_never_from_the_scope() {
        assert_eq!(Tier::of("ping", Signer::Operator), Tier::Operator);
        assert_eq!(Tier::of("apply-config", Signer::Operator), Tier::Operator);
        assert_eq!(Tier::of("apply-config", Signer::Unsigned), Tier::Push);
        assert_eq!(Tier::of("apply-config", Signer::Unknown), Tier::Push);
        assert_eq!(Tier::of("ping", Signer::Unsigned), Tier::Other);
        assert_eq!(Tier::of("ping", Signer::Unknown), Tier::Other);
    }

    #[test]
    fn a_peek_gives_the_operators_room_only_to_a_signature_that_verifies() {
        let (k, stranger) = (key(), key());
        let keys = OperatorKeys::new("gw1", &[k.public()]);
        let ping = json!({"command_id": "x", "scope": "ops", "name": "ping"});
        let signed = super::super::signed::sign(&k, "gw1", &ping).expect("signed");
        assert_eq!(peek(&bytes(&signed), 65536, &keys), Tier::Operator);
        // The scope that once meant "operator", alone, is nobody's.
        assert_eq!(peek(&bytes(&ping), 65536, &keys), Tier::Other);
        let push = json!({"command_id": "x", "name": "apply-config", "args": {"config": "[a]"}});
        assert_eq!(peek(&bytes(&push), 65536, &keys), Tier::Push);
        for forged in [
            super::super::signed::sign(&stranger, "gw1", &ping).expect("signed"),
            super::super::signed::sign(&k, "gw2", &ping).expect("signed"),
            {
                let mut t = signed.clone();
                t["command_id"] = "y".into();
                t
            },
            {
                let mut t = signed.clone();
                t["name"] = "status".into();
                t
            },
        ] {
            assert_eq!(peek(&bytes(&forged), 65536, &keys), Tier::Other, "{forged}");
        }
        // Over the size a command may have: not parsed, not the operator's.
        assert_eq!(peek(&bytes(&signed), 16, &keys), Tier::Other);
        // No key listed: nobody is the operator, and no signature is checked.
        let none = OperatorKeys::new("gw1", &[]);
        assert_eq!(peek(&bytes(&signed), 65536, &none), Tier::Other);
        for junk in [
            &b"{\"scope\":\"ops\",\"name\":"[..],
            &[0xff, 0xfe][..],
            br#"{"name":7}"#,
            br#"["ops"]"#,
            br#"{"name":"ping","name":"ping"}"#,
        ] {
            assert_eq!(peek(junk, 65536, &keys), Tier::Other, "{junk:?}");
        }
    }

    #[test]
    fn unsigned_commands_with_a_side_effect_are_refused_unless_the_board_allows_them() {
        let refusal = |v: serde_json::Value, signer, allow| {
            unsigned_refusal(&command(&v), signer, true, allow, 1)
        };
        let checkpoint = json!({"command_id": "c", "name": "checkpoint"});
        let why = refusal(checkpoint.clone(), Signer::Unsigned, false).unwrap_or_default();
        assert!(
            why.starts_with("unsigned: ") && why.contains("allow_unsigned"),
            "{why}"
        );
        assert_eq!(refusal(checkpoint.clone(), Signer::Unsigned, true), None);
        assert_eq!(refusal(checkpoint.clone(), Signer::Operator, false), None);
        // A bad signature is refused whatever allow_unsigned says, even on ping.
        for allow in [false, true] {
            let ping = json!({"command_id": "c", "name": "ping"});
            let why = refusal(ping, Signer::Unknown, allow).unwrap_or_default();
            assert!(why.contains("verifies with none"), "{why}");
        }
        // Open to anyone: ping, status, a signed whole config; unknown
        // names are rejected as unknown instead.
        for open in [
            json!({"command_id": "c", "name": "ping"}),
            json!({"command_id": "c", "name": "status"}),
            json!({"command_id": "c", "name": "apply-config",
                   "args": {"config": "x", "sha256": "y", "signature": "z"}}),
        ] {
            assert_eq!(
                refusal(open.clone(), Signer::Unsigned, false),
                None,
                "{open}"
            );
        }
        let overlay = json!({"command_id": "c", "name": "apply-config",
                             "args": {"config": "x", "sha256": "y"}});
        assert!(refusal(overlay, Signer::Unsigned, false).is_some());
        let unknown = command(&json!({"command_id": "c", "name": "no-such"}));
        assert_eq!(
            unsigned_refusal(&unknown, Signer::Unsigned, false, false, 0),
            None
        );
    }

    #[test]
    fn every_bound_keeps_a_quarter_for_the_operator_and_half_of_it_for_pushes() {
        assert_eq!(Tier::Other.cap(10_000), 7_500);
        assert_eq!(Tier::Push.cap(10_000), 8_750);
        assert_eq!(Tier::Operator.cap(10_000), 10_000);
        assert_eq!(Tier::Other.cap(100), 75);
        assert_eq!(Tier::Push.cap(100), 88);
        // Small bounds: nothing is withheld from a lane of one.
        assert_eq!(Tier::Other.cap(1), 1);
        assert_eq!(Tier::Other.cap(4), 3);
        for n in [1, 3, 8, 1000, 4 * 1024 * 1024] {
            assert!(Tier::Other.cap(n) <= Tier::Push.cap(n));
            assert!(Tier::Push.cap(n) <= Tier::Operator.cap(n));
            assert!(Tier::Other.cap(n) >= 1 && Tier::Operator.cap(n) == n);
        }
        assert_eq!(Tier::Other.headroom(3000), 3000);
        assert_eq!(Tier::Push.headroom(3000), 3500);
        assert_eq!(Tier::Operator.headroom(3000), 4000, "3000 is 3/4 of it");
        // The operator's order: first.
        let mut tiers = [Tier::Other, Tier::Operator, Tier::Push];
        tiers.sort_by_key(|t| t.rank());
        assert_eq!(tiers, [Tier::Operator, Tier::Push, Tier::Other]);
    }

    #[test]
    fn invented_scopes_share_one_global_budget_and_cannot_spend_the_operators() {
        let mut b = Budgets::new(60, 100, 600_000);
        let mut other = 0;
        for i in 0..5000 {
            let scope = format!("j{i}");
            if b.refusal(&scope, Tier::Other, true, s(0.0)).is_none() {
                b.take(&scope, Tier::Other, true, s(0.0));
                other += 1;
            }
        }
        assert_eq!(other, 100, "the global budget, not 5000 scopes x 60");
        let why = b
            .refusal("j-new", Tier::Other, true, s(0.0))
            .unwrap_or_default();
        assert!(why.contains("commands.max_per_minute)"), "{why}");
        // The operator still has its whole burst.
        let mut op = 0;
        while b.refusal("ops", Tier::Operator, true, s(0.0)).is_none() {
            b.take("ops", Tier::Operator, true, s(0.0));
            op += 1;
        }
        assert_eq!(op, 60);
        let why = b
            .refusal("ops", Tier::Operator, true, s(0.0))
            .unwrap_or_default();
        assert!(why.contains("max_per_minute_per_scope"), "{why}");
        // Pushes from invented scopes have their own budget of 60.
        let mut pushes = 0;
        for i in 0..500 {
            let scope = format!("p{i}");
            if b.refusal(&scope, Tier::Push, true, s(0.0)).is_none() {
                b.take(&scope, Tier::Push, true, s(0.0));
                pushes += 1;
            }
        }
        assert_eq!(pushes, 60);
        // What does not run (a ping, an unknown name) is held to its
        // scope's limit only.
        assert!(b.refusal("j-new", Tier::Other, false, s(0.0)).is_none());
        b.take("j-new", Tier::Other, false, s(0.0));
        assert!(b.refusal("j-new", Tier::Other, true, s(0.0)).is_some());
        // A minute later every budget is full again.
        assert!(b.refusal("j-new", Tier::Other, true, s(60.0)).is_none());
        assert!(b.refusal("ops", Tier::Operator, true, s(60.0)).is_none());
        assert!(b.refusal("p-new", Tier::Push, true, s(60.0)).is_none());
    }

    #[test]
    fn an_operator_scope_keeps_its_own_bucket_however_many_scopes_were_invented() {
        let mut b = Budgets::new(5, 1_000_000, 600_000);
        for i in 0..3 * super::super::rate::MAX_SCOPES {
            let scope = format!("j{i}");
            if b.refusal(&scope, Tier::Other, true, s(0.0)).is_none() {
                b.take(&scope, Tier::Other, true, s(0.0));
            }
        }
        for _ in 0..5 {
            assert!(b.refusal("ops", Tier::Operator, true, s(0.0)).is_none());
            b.take("ops", Tier::Operator, true, s(0.0));
        }
        assert!(b.refusal("ops", Tier::Operator, true, s(0.0)).is_some());
    }

    #[test]
    fn answers_at_receipt_are_bounded_per_tier_and_the_operator_is_never_held_to_it() {
        let mut b = Budgets::new(60, 600, 100);
        let others = (0..1_000).filter(|_| b.answer(Tier::Other, s(0.0))).count();
        assert_eq!(others, 100, "a burst of max_answers_per_minute");
        // Pushes of other scopes have their own 60, which the flood above
        // did not touch; the operator is never refused.
        let pushes = (0..1_000).filter(|_| b.answer(Tier::Push, s(0.0))).count();
        assert_eq!(pushes, 60);
        assert!((0..1_000).all(|_| b.answer(Tier::Operator, s(0.0))));
        // Refilled at the budget's rate: 100 a minute, so 10 in 6 s.
        let later = (0..1_000).filter(|_| b.answer(Tier::Other, s(6.0))).count();
        assert_eq!(later, 10);
    }
}
