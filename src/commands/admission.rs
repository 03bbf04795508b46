//! Who gets room: the operator's reserved share of every bound a command
//! can fill, and the global budgets no invented scope escapes.
//!
//! Its one rule: **a sender on the command topic cannot take the room the
//! operator's commands need**. Every command falls in one [`Tier`]:
//!
//! - [`Tier::Operator`]: its scope is one of `commands.operator_scopes`
//!   (the board's own config names them; nothing a command sends can);
//! - [`Tier::Push`]: `apply-config` in any other scope (a push is judged by
//!   its own policy: `[commands.config_push]`, overlay bounds, signatures);
//! - [`Tier::Other`]: everything else.
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
//! another scope takes one from a budget shared by all such scopes
//! (`commands.max_per_minute`) as well, so inventing scopes buys nothing; a
//! push from a budget of `max_per_minute_per_scope` per minute shared by
//! every push from a non-operator scope. Operator scopes have buckets of
//! their own, kept apart (invented scopes never push them into the shared
//! overflow bucket), and no global budget. A command over its rate is
//! answered `rate_limited`, not recorded.
//!
//! Answers: every answer is a spool commit (its record, its result event),
//! so what other scopes can make the board write is bounded too. A message
//! of another scope answered at receipt (anything not accepted to run:
//! `ping`, `status`, unknown names, malformed messages, duplicates,
//! `rate_limited` and `no_room` answers) takes a token from a budget all
//! those scopes share (`commands.max_answers_per_minute`); one from a push
//! of another scope from a budget of `max_per_minute_per_scope` shared by
//! every such push. With none left the message is acknowledged and
//! dropped unanswered: nothing is recorded, it is counted
//! (`commands_unanswered`), and a sender that wants an answer sends it
//! again later. Operator scopes spend neither.
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
//! new command of another scope is answered `no_room` (not recorded: send it
//! again later), and an operator command or a push is held back
//! (unacknowledged) until there is room: that can only happen once the
//! operator's own commands (or pushes) have filled the reserve.
//!
//! Order: the command thread takes operator commands first, then pushes,
//! then the rest, whatever order they arrived in; in a lane's queue
//! operator commands wait ahead of pushes, pushes ahead of the rest.
//!
//! What a sender on the command topic can and cannot do:
//! - it can run what the board's config lets any command run (the broker's
//!   ACL on the command topic is the only gate), spend the shared budgets,
//!   fill the other tiers' share of records with commands that ran, and so
//!   deny room to other non-operator scopes for up to the redelivery window;
//! - it cannot fill the operator's share of records, lanes or the inbox,
//!   spend an operator scope's rate, have its commands handled before an
//!   operator command, or get a command that ran with a side effect run
//!   twice; its answers, though, are events of the `_commands` stream like
//!   the operator's, delivered in order: the operator's answer follows the
//!   answers to what was handled before it;
//! - the scope is a claim the sender makes, not an identity: a sender that
//!   names an operator scope is treated as the operator. Keep operator
//!   scope names out of reach of other senders, and restrict who may
//!   publish to the command topic at the broker.

use super::rate::{Budget, RateLimiter};
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
    /// `apply-config` in a scope that is not an operator scope.
    Push,
    /// A command in one of `commands.operator_scopes`.
    Operator,
}

impl Tier {
    /// The tier of a command named `name` in `scope`.
    pub fn of(scope: &str, name: &str, operator_scopes: &[String]) -> Tier {
        if operator_scopes.iter().any(|s| s == scope) {
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

/// The tier of a command message judged from its `scope` and `name`
/// alone, before it is parsed in full (the MQTT thread's inbox does this):
/// a message that is no JSON object with string fields is [`Tier::Other`].
pub fn peek(payload: &[u8], operator_scopes: &[String]) -> Tier {
    #[derive(Deserialize)]
    struct Peek<'a> {
        #[serde(borrow, default)]
        scope: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        name: Option<Cow<'a, str>>,
    }
    // serde reads a struct from an array too: only an object is a command.
    let object = payload
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'{');
    if !object {
        return Tier::Other;
    }
    match serde_json::from_slice::<Peek<'_>>(payload) {
        Ok(p) => Tier::of(
            p.scope.as_deref().unwrap_or(super::DEFAULT_SCOPE),
            p.name.as_deref().unwrap_or(""),
            operator_scopes,
        ),
        Err(_) => Tier::Other,
    }
}

/// The rate budgets of new commands, by tier. Time is passed in (a
/// monotonic offset).
#[derive(Debug)]
pub struct Budgets {
    per_scope: u32,
    per_minute: u32,
    /// Per scope, every scope that is not an operator scope.
    scopes: RateLimiter,
    /// Per scope, the operator scopes only.
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
                "rate limit: more than {} new commands per minute from scopes that are not \
                 operator scopes (commands.max_per_minute); not recorded: send it again later",
                self.per_minute
            )),
            Tier::Push if !self.pushes.allows(now) => Some(format!(
                "rate limit: more than {} apply-config commands per minute from scopes that \
                 are not operator scopes (commands.max_per_minute_per_scope); not recorded: \
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

    fn ops() -> Vec<String> {
        vec!["ops".to_owned(), "ops-2".to_owned()]
    }

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    #[test]
    fn the_tier_comes_from_the_local_operator_scopes_and_the_name() {
        assert_eq!(Tier::of("ops", "ping", &ops()), Tier::Operator);
        assert_eq!(Tier::of("ops-2", "apply-config", &ops()), Tier::Operator);
        assert_eq!(Tier::of("anyone", "apply-config", &ops()), Tier::Push);
        assert_eq!(Tier::of("anyone", "ping", &ops()), Tier::Other);
        assert_eq!(Tier::of("OPS", "ping", &ops()), Tier::Other, "exact match");
        assert_eq!(Tier::of("default", "ping", &[]), Tier::Other);
    }

    #[test]
    fn a_peek_reads_scope_and_name_only_and_anything_else_is_other() {
        let o = ops();
        let push = br#"{"command_id":"x","name":"apply-config","args":{"config":"[a]"}}"#;
        assert_eq!(peek(push, &o), Tier::Push);
        let op = br#"{"scope":"ops","command_id":"x","name":"no-such","junk":[1,{"a":2}]}"#;
        assert_eq!(peek(op, &o), Tier::Operator);
        assert_eq!(
            peek(br#"{"command_id":"x","name":"ping"}"#, &o),
            Tier::Other
        );
        assert_eq!(
            peek(br#"{"command_id":"x","name":"ping"}"#, &["default".into()]),
            Tier::Operator,
            "no scope is the default scope"
        );
        for junk in [
            &b"{\"scope\":\"ops\",\"name\":"[..],
            &[0xff, 0xfe][..],
            br#"{"scope":7,"name":"ping"}"#,
            br#"["ops"]"#,
            br#"{"scope":"ops","scope":"ops","name":"ping"}"#,
        ] {
            assert_eq!(peek(junk, &o), Tier::Other, "{junk:?}");
        }
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
        // The operator scope still has its whole burst.
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
