//! The write budget's families: the budget the board was given, the commit
//! window in force, and whether the agent judges it over the budget. The
//! projection they are compared with is `edgespool_flash_projected_bytes_per_day`
//! ([`super::outage`]), the same figure `status` and health show, so the
//! shipped alert follows each board's own budget.
//!
//! One rule: **no budget, no budget sample** (its HELP and TYPE only): a
//! board without one is never compared with a made-up figure.

use super::Out;

/// The write budget as the last summary saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BudgetFigures {
    /// `spool.write_budget_mb_per_day` in bytes a day; `None`: no budget.
    pub budget_bytes_per_day: Option<f64>,
    /// The commit window in force, seconds.
    pub window_secs: f64,
    /// Over the budget at the widest window allowed (health says so too).
    pub over: bool,
}

/// The families of `b`.
pub(super) fn render(o: &mut Out, b: &BudgetFigures) {
    let name = "edgespool_write_budget_bytes_per_day";
    o.family(
        name,
        "gauge",
        "The flash write budget, bytes (10^6 per MB) a day (spool.write_budget_mb_per_day); no sample without a budget.",
    );
    if let Some(v) = b.budget_bytes_per_day {
        o.sample(name, &[], v);
    }
    o.single(
        "edgespool_write_budget_exceeded",
        "gauge",
        "1 while the projected flash writes are over the write budget at the widest commit window allowed (health is degraded), else 0.",
        if b.over { 1.0 } else { 0.0 },
    );
    o.single(
        "edgespool_commit_window_seconds",
        "gauge",
        "The commit window of batched readings in force (the write budget's choice, or the configured one), seconds.",
        b.window_secs,
    );
}

#[cfg(test)]
mod tests {
    use super::BudgetFigures;
    use crate::metrics::{render, Figures};

    #[test]
    fn the_budget_is_shown_only_when_the_board_has_one() {
        let none = render(&Figures {
            write_budget: Some(BudgetFigures {
                budget_bytes_per_day: None,
                window_secs: 0.2,
                over: false,
            }),
            ..Figures::default()
        });
        assert!(none.contains("# TYPE edgespool_write_budget_bytes_per_day gauge"));
        assert!(
            !none.contains("\nedgespool_write_budget_bytes_per_day "),
            "{none}"
        );
        assert!(
            none.contains("\nedgespool_commit_window_seconds 0.2\n"),
            "{none}"
        );
        assert!(
            none.contains("\nedgespool_write_budget_exceeded 0\n"),
            "{none}"
        );
        let set = render(&Figures {
            write_budget: Some(BudgetFigures {
                budget_bytes_per_day: Some(1e8),
                window_secs: 150.0,
                over: true,
            }),
            ..Figures::default()
        });
        assert!(
            set.contains("\nedgespool_write_budget_bytes_per_day 100000000\n"),
            "{set}"
        );
        assert!(
            set.contains("\nedgespool_write_budget_exceeded 1\n"),
            "{set}"
        );
    }
}
