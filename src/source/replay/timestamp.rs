//! Timestamps of a trace: the `timezone` setting ([`parse_timezone`]) and
//! the `timestamp_format` that reads a row's timestamp text into unix
//! milliseconds ([`TsFormat`]), both by `jiff`.
//!
//! One rule: a format is accepted only once it has read back its own
//! output in the configured zone, so a format that cannot give a date fails
//! at open (and in `check-config`), never row by row.

use jiff::fmt::strtime;
use jiff::tz::TimeZone;

/// A `timezone` setting: `"UTC"` (also `"Z"`), a fixed offset (`"+01:00"`,
/// `"-0530"`), or an IANA name looked up in the system's zoneinfo
/// (`/usr/share/zoneinfo`, e.g. `"Europe/Rome"`).
///
/// # Errors
///
/// A one-line reason naming the value.
pub fn parse_timezone(text: &str) -> Result<TimeZone, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err(
            "empty: write \"UTC\", an offset like \"+01:00\" or a zone like \"Europe/Rome\""
                .to_owned(),
        );
    }
    if t.eq_ignore_ascii_case("utc") || t == "Z" {
        return Ok(TimeZone::UTC);
    }
    if t.starts_with(['+', '-']) {
        for format in ["%:z", "%z"] {
            if let Some(offset) = strtime::parse(format, t).ok().and_then(|tm| tm.offset()) {
                return Ok(TimeZone::fixed(offset));
            }
        }
        return Err(format!(
            "{t:?} is not an offset like \"+01:00\" or \"-0530\""
        ));
    }
    TimeZone::get(t).map_err(|e| format!("unknown time zone {t:?}: {e}"))
}

/// A `timestamp_format`, read by jiff's strptime
/// (<https://docs.rs/jiff/latest/jiff/fmt/strtime/index.html>): `%d %m %Y
/// %H %M %S` as before (numbers need no leading zeros; `%Y` takes 1 to 4
/// digits, so `04` is the year 4: use `%y` for two-digit years; a leap
/// second `:60` reads as `:59`), plus `%.f`
/// (fractional seconds), `%z`/`%:z` (an offset in the text), `%Q` (an IANA
/// zone in the text), `%s` (epoch seconds), `%b`, `%y`, `%j` and the rest
/// of jiff's set; every other character is literal, a space matches any run
/// of whitespace. A text with an offset, zone or epoch seconds is read as
/// such; a bare wall time is read in the configured zone, and a wall time
/// a DST change makes ambiguous or skips is resolved the way RFC 5545 does
/// (jiff's "compatible": the earlier of two, the later across a gap).
#[derive(Debug, Clone)]
pub struct TsFormat {
    pub(super) format: String,
    tz: TimeZone,
}

impl TsFormat {
    /// Checks `format` by writing a known instant with it and reading it
    /// back, and resolves `timezone` ([`parse_timezone`]).
    ///
    /// # Errors
    ///
    /// A one-line reason: empty format, an unknown directive, a format that
    /// does not give a date (for example `"%H:%M"`), or a bad `timezone`.
    pub fn compile(format: &str, timezone: &str) -> Result<TsFormat, String> {
        if format.trim().is_empty() {
            return Err("timestamp_format is empty".to_owned());
        }
        let tz = parse_timezone(timezone).map_err(|e| format!("timezone: {e}"))?;
        let f = TsFormat {
            format: format.to_owned(),
            tz: tz.clone(),
        };
        // 2004-03-10T18:07:09.25Z, in the zone the texts will be read in.
        let probe = jiff::Timestamp::from_millisecond(1_078_942_029_250)
            .map_err(|e| e.to_string())?
            .to_zoned_datetime(tz);
        let text = strtime::format(format, &probe)
            .map_err(|e| format!("timestamp_format {format:?}: {e}"))?;
        f.parse_ms(&text).map_err(|e| {
            format!("timestamp_format {format:?} cannot read back its own output {text:?}: {e}")
        })?;
        Ok(f)
    }

    /// Unix milliseconds of `text`. The whole text must match.
    ///
    /// # Errors
    ///
    /// jiff's one-line reason: a literal not matching, digits missing,
    /// trailing text, a field out of range (month 13, 31 April, 29 February
    /// of a common year, hour 24...), an unknown zone named in the text.
    pub fn parse_ms(&self, text: &str) -> Result<i64, String> {
        let tm = strtime::parse(&self.format, text).map_err(|e| e.to_string())?;
        let ts = if tm.timestamp().is_some() || tm.offset().is_some() {
            tm.to_timestamp().map_err(|e| e.to_string())?
        } else {
            let dt = tm.to_datetime().map_err(|e| e.to_string())?;
            let named;
            let tz = match tm.iana_time_zone() {
                Some(name) => {
                    named = TimeZone::get(name).map_err(|e| e.to_string())?;
                    &named
                }
                None => &self.tz,
            };
            tz.to_ambiguous_timestamp(dt)
                .compatible()
                .map_err(|e| e.to_string())?
        };
        Ok(ts.as_millisecond())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_format_compile_errors() {
        for good in [
            "%d/%m/%Y %H.%M.%S",
            "%Y-%m-%d",
            "%d%%%m%%%Y",
            "%y-%m-%d",
            "%s",
            "%Y-%m-%dT%H:%M:%S%.f%:z",
            "%Y-%m-%d %H:%M:%S %Q",
        ] {
            assert!(TsFormat::compile(good, "UTC").is_ok(), "{good:?}");
        }
        for bad in [
            "%d/%m/%Y %H:%M:%q",
            "%d/%m/%Y %",
            "%d/%m %H",
            "%H:%M",
            "",
            "  ",
        ] {
            let e = TsFormat::compile(bad, "UTC").unwrap_err();
            println!("{bad:?}: {e}");
            assert!(e.contains("timestamp_format"), "{bad:?}: {e}");
        }
        let e = TsFormat::compile("%Y-%m-%d", "Mars/Olympus").unwrap_err();
        assert!(e.contains("timezone") && e.contains("Mars/Olympus"), "{e}");
    }

    #[test]
    fn timezones_named_fixed_and_utc() {
        assert_eq!(parse_timezone("UTC").unwrap(), TimeZone::UTC);
        assert!(
            parse_timezone("").is_err(),
            "an empty timezone is a mistake, not UTC"
        );
        let plus_one = jiff::tz::Offset::from_seconds(3600).unwrap();
        assert_eq!(parse_timezone("+01:00").unwrap(), TimeZone::fixed(plus_one));
        assert_eq!(parse_timezone("+0100").unwrap(), TimeZone::fixed(plus_one));
        for bad in ["+1h", "-", "Nowhere/Atlantis"] {
            assert!(parse_timezone(bad).is_err(), "{bad:?}");
        }
        let f = TsFormat::compile("%d/%m/%Y %H.%M.%S", "+01:00").unwrap();
        assert_eq!(f.parse_ms("10/03/2004 19.00.00"), Ok(1_078_941_600_000));
        if std::path::Path::new("/usr/share/zoneinfo/Europe/Rome").exists() {
            let rome = TsFormat::compile("%d/%m/%Y %H.%M.%S", "Europe/Rome").unwrap();
            // Winter (CET, +1) and summer (CEST, +2).
            assert_eq!(rome.parse_ms("10/03/2004 19.00.00"), Ok(1_078_941_600_000));
            assert_eq!(rome.parse_ms("10/07/2004 20.00.00"), Ok(1_089_482_400_000));
            // 02:30 does not exist on 27/03/2005: read as 03:30 CEST.
            assert_eq!(
                rome.parse_ms("27/03/2005 02.30.00"),
                rome.parse_ms("27/03/2005 03.30.00")
            );
        } else {
            println!("no zoneinfo for Europe/Rome here; named-zone case skipped");
        }
    }

    #[test]
    fn timestamps_with_fractions_offsets_zones_and_epochs() {
        let iso = TsFormat::compile("%Y-%m-%dT%H:%M:%S%.f%:z", "Europe/Rome");
        let iso = iso
            .or_else(|_| TsFormat::compile("%Y-%m-%dT%H:%M:%S%.f%:z", "UTC"))
            .unwrap();
        // The offset in the text wins over the configured zone.
        assert_eq!(
            iso.parse_ms("2004-03-10T20:00:00.250+02:00"),
            Ok(1_078_941_600_250)
        );
        let epoch = TsFormat::compile("%s", "+05:00").unwrap();
        assert_eq!(epoch.parse_ms("1078941600"), Ok(1_078_941_600_000));
        let bad = iso.parse_ms("2004-03-10T20:00:00").unwrap_err();
        assert!(!bad.is_empty());
    }

    #[test]
    fn timestamp_parses_to_unix_ms() {
        let f = TsFormat::compile("%d/%m/%Y %H.%M.%S", "UTC").unwrap();
        // Expected values from `date -u -d '...' +%s`.
        for (text, secs) in [
            ("10/03/2004 18.00.00", 1_078_941_600),
            ("04/04/2005 14.00.00", 1_112_623_200),
            ("01/01/1970 00.00.00", 0),
            ("31/12/1969 23.59.59", -1),
            ("29/02/2000 12.34.56", 951_827_696),
            ("01/03/1900 00.00.00", -2_203_891_200),
            ("31/12/2024 23.59.59", 1_735_689_599),
            ("1/1/1970 0.0.1", 1),
        ] {
            assert_eq!(f.parse_ms(text), Ok(secs * 1000), "{text}");
        }
        let iso = TsFormat::compile("%Y-%m-%dT%H:%M:%SZ", "UTC").unwrap();
        assert_eq!(iso.parse_ms("2004-03-10T18:00:00Z"), Ok(1_078_941_600_000));
        let date_only = TsFormat::compile("%Y%m%d", "UTC").unwrap();
        assert_eq!(date_only.parse_ms("20040310"), Ok(1_078_876_800_000));
    }

    #[test]
    fn timestamp_rejects_bad_values_and_literals() {
        let f = TsFormat::compile("%d/%m/%Y %H.%M.%S", "UTC").unwrap();
        for bad in [
            "10/13/2004 18.00.00",     // month 13
            "10/00/2004 18.00.00",     // month 0
            "00/03/2004 18.00.00",     // day 0
            "32/03/2004 18.00.00",     // day 32
            "31/04/2004 18.00.00",     // April has 30
            "29/02/2005 18.00.00",     // not a leap year
            "29/02/1900 18.00.00",     // century, not leap
            "10/03/2004 24.00.00",     // hour 24
            "10/03/2004 18.60.00",     // minute 60
            "10-03-2004 18.00.00",     // wrong literal
            "10/03/2004 18:00:00",     // wrong literal
            "10/03/2004 18.00.00 UTC", // trailing text
            "10/03/2004 18.00.0x",
            "10/03/2004 18.00",
            "10/03/2004",
            "",
            "100/03/2004 18.00.00",
            "1é/03/2004 18.00.00",
        ] {
            assert!(f.parse_ms(bad).is_err(), "{bad:?}");
        }
        assert!(f.parse_ms("29/02/2004 18.00.00").is_ok());
        // jiff's %Y takes 1 to 4 digits: "04" is the year 4 (use %y for
        // two-digit years, which jiff maps to 1969..=2068).
        let y4 = f.parse_ms("10/03/04 18.00.00").unwrap();
        assert!(y4 < -60_000_000_000_000, "{y4}");
        // A space in the format matches any run of whitespace.
        assert!(f.parse_ms("10/03/2004  18.00.00").is_ok());
        // jiff reads a leap second as :59 of the same minute.
        assert_eq!(
            f.parse_ms("10/03/2004 18.00.60"),
            f.parse_ms("10/03/2004 18.00.59")
        );
        assert!(f.parse_ms("29/02/2000 18.00.00").is_ok());
    }
}
