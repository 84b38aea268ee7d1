//! A record's payload bytes: encoding from borrowed fields and decoding of
//! untrusted bytes, every read bounds-checked.

use super::layout::{MAX_SLOTS, MAX_STRING, MAX_TOKEN_IDS, len_u32};
use super::record::{JournalRecord, RecoveredNamespace, RecoveredPage};

pub(super) const TAG_NAMESPACE: u8 = 1;
pub(super) const TAG_READY: u8 = 2;
pub(super) const TAG_REMOVED: u8 = 3;
pub(super) const TAG_HELD: u8 = 4;
pub(super) const TAG_FREED: u8 = 5;

/// A record's fields, borrowed from a [`JournalRecord`] or from the mirror.
#[derive(Debug, Clone, Copy)]
pub(super) enum View<'a> {
    Namespace {
        id: u64,
        compat: u64,
        lora_name: Option<&'a str>,
        cache_salt: Option<&'a str>,
    },
    Ready {
        namespace: u64,
        key: u64,
        layout: u16,
        slots: &'a [u32],
        parent: Option<u64>,
        token_ids: &'a [u32],
    },
    Removed {
        namespace: u64,
        key: u64,
    },
    Held(&'a [u32]),
    Freed(&'a [u32]),
}

impl JournalRecord {
    pub(super) fn view(&self) -> View<'_> {
        match self {
            Self::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => View::Namespace {
                id: *id,
                compat: *compat,
                lora_name: lora_name.as_deref(),
                cache_salt: cache_salt.as_deref(),
            },
            Self::Ready {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            } => View::Ready {
                namespace: *namespace,
                key: *key,
                layout: *layout,
                slots,
                parent: *parent,
                token_ids,
            },
            Self::Removed { namespace, key } => View::Removed {
                namespace: *namespace,
                key: *key,
            },
            Self::Held { slots } => View::Held(slots),
            Self::Freed { slots } => View::Freed(slots),
        }
    }
}

impl RecoveredNamespace {
    pub(super) fn view(&self) -> View<'_> {
        View::Namespace {
            id: self.id,
            compat: self.compat,
            lora_name: self.lora_name.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
        }
    }
}

impl RecoveredPage {
    pub(super) fn view(&self) -> View<'_> {
        View::Ready {
            namespace: self.namespace,
            key: self.key,
            layout: self.layout,
            slots: &self.slots,
            parent: self.parent,
            token_ids: &self.token_ids,
        }
    }
}

fn opt_str_len(s: Option<&str>) -> usize {
    s.map_or(1, |s| 1 + 4 + s.len())
}

fn put_opt_str(buf: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => buf.push(0),
        Some(s) => {
            buf.push(1);
            buf.extend_from_slice(&len_u32(s.len()).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }
    }
}

fn put_u32s(buf: &mut Vec<u8>, values: &[u32]) {
    buf.extend_from_slice(&len_u32(values.len()).to_le_bytes());
    for v in values {
        buf.extend_from_slice(&v.to_le_bytes());
    }
}

impl View<'_> {
    /// Bytes of the payload [`Self::encode`] writes.
    pub(super) fn payload_len(&self) -> usize {
        match self {
            Self::Namespace {
                lora_name,
                cache_salt,
                ..
            } => 1 + 8 + 8 + opt_str_len(*lora_name) + opt_str_len(*cache_salt),
            Self::Ready {
                slots,
                parent,
                token_ids,
                ..
            } => {
                1 + 8
                    + 8
                    + 2
                    + 1
                    + parent.map_or(0, |_| 8)
                    + 4
                    + 4 * slots.len()
                    + 4
                    + 4 * token_ids.len()
            }
            Self::Removed { .. } => 1 + 8 + 8,
            Self::Held(slots) | Self::Freed(slots) => 1 + 4 + 4 * slots.len(),
        }
    }

    pub(super) fn encode(&self, buf: &mut Vec<u8>) {
        match self {
            Self::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => {
                buf.push(TAG_NAMESPACE);
                buf.extend_from_slice(&id.to_le_bytes());
                buf.extend_from_slice(&compat.to_le_bytes());
                put_opt_str(buf, *lora_name);
                put_opt_str(buf, *cache_salt);
            }
            Self::Ready {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            } => {
                buf.push(TAG_READY);
                buf.extend_from_slice(&namespace.to_le_bytes());
                buf.extend_from_slice(&key.to_le_bytes());
                buf.extend_from_slice(&layout.to_le_bytes());
                match parent {
                    None => buf.push(0),
                    Some(p) => {
                        buf.push(1);
                        buf.extend_from_slice(&p.to_le_bytes());
                    }
                }
                put_u32s(buf, slots);
                put_u32s(buf, token_ids);
            }
            Self::Removed { namespace, key } => {
                buf.push(TAG_REMOVED);
                buf.extend_from_slice(&namespace.to_le_bytes());
                buf.extend_from_slice(&key.to_le_bytes());
            }
            Self::Held(slots) => {
                buf.push(TAG_HELD);
                put_u32s(buf, slots);
            }
            Self::Freed(slots) => {
                buf.push(TAG_FREED);
                put_u32s(buf, slots);
            }
        }
    }
}

/// A cursor over untrusted payload bytes; every read is bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

const TRUNCATED: &str = "a record's payload is truncated";

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        let end = self.pos.checked_add(n).ok_or(TRUNCATED)?;
        let out = self.bytes.get(self.pos..end).ok_or(TRUNCATED)?;
        self.pos = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, &'static str> {
        self.take(1)?.first().copied().ok_or(TRUNCATED)
    }

    fn u16(&mut self) -> Result<u16, &'static str> {
        let b: [u8; 2] = self.take(2)?.try_into().map_err(|_| TRUNCATED)?;
        Ok(u16::from_le_bytes(b))
    }

    fn u32(&mut self) -> Result<u32, &'static str> {
        let b: [u8; 4] = self.take(4)?.try_into().map_err(|_| TRUNCATED)?;
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, &'static str> {
        let b: [u8; 8] = self.take(8)?.try_into().map_err(|_| TRUNCATED)?;
        Ok(u64::from_le_bytes(b))
    }

    fn flag(&mut self) -> Result<bool, &'static str> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err("an option flag is neither 0 nor 1"),
        }
    }

    /// A count-prefixed list of at most `max` u32s, allocated only once the
    /// bytes are known to be there.
    fn u32s(&mut self, max: usize) -> Result<Vec<u32>, &'static str> {
        let count = usize::try_from(self.u32()?).map_err(|_| "a list is over its cap")?;
        if count > max {
            return Err("a list is over its cap");
        }
        let bytes = self.take(count.checked_mul(4).ok_or(TRUNCATED)?)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| <[u8; 4]>::try_from(c).map_or(0, u32::from_le_bytes))
            .collect())
    }

    fn opt_str(&mut self) -> Result<Option<String>, &'static str> {
        if !self.flag()? {
            return Ok(None);
        }
        let len = usize::try_from(self.u32()?).map_err(|_| "a string is over its cap")?;
        if len > MAX_STRING {
            return Err("a string is over its cap");
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map(Some)
            .map_err(|_| "a string is not UTF-8")
    }

    fn opt_u64(&mut self) -> Result<Option<u64>, &'static str> {
        if self.flag()? {
            Ok(Some(self.u64()?))
        } else {
            Ok(None)
        }
    }
}

pub(super) fn decode(payload: &[u8]) -> Result<JournalRecord, &'static str> {
    let mut r = Reader {
        bytes: payload,
        pos: 0,
    };
    let record = match r.u8()? {
        TAG_NAMESPACE => JournalRecord::Namespace {
            id: r.u64()?,
            compat: r.u64()?,
            lora_name: r.opt_str()?,
            cache_salt: r.opt_str()?,
        },
        TAG_READY => JournalRecord::Ready {
            namespace: r.u64()?,
            key: r.u64()?,
            layout: r.u16()?,
            parent: r.opt_u64()?,
            slots: r.u32s(MAX_SLOTS)?,
            token_ids: r.u32s(MAX_TOKEN_IDS)?,
        },
        TAG_REMOVED => JournalRecord::Removed {
            namespace: r.u64()?,
            key: r.u64()?,
        },
        TAG_HELD => JournalRecord::Held {
            slots: r.u32s(MAX_SLOTS)?,
        },
        TAG_FREED => JournalRecord::Freed {
            slots: r.u32s(MAX_SLOTS)?,
        },
        _ => return Err("unknown record tag"),
    };
    if r.pos != payload.len() {
        return Err("a record's payload has trailing bytes");
    }
    Ok(record)
}
