//! The prefix index: which cached page holds the keys and values of a given
//! run of tokens at given positions, so that prompts sharing a prefix store
//! it once.
//!
//! A page's key chains the key of the page before it with the page's own
//! tokens: `key_i = H(key_{i-1}, tokens[i * page_size .. (i + 1) * page_size])`,
//! and the chain's root is the sequence's salt: `key_{-1} = 0` without one,
//! `H(salt)` with one, so sequences of different salts never share a page
//! (a server gives each API key or each `cache_salt` its own). A key names
//! the whole prefix up to the end of its page (hence the positions too).
//! `H` is 128 bits: two SipHash-1-3 states with different domains, keyed
//! with a per-process random key, so no one outside the process can compute
//! or aim for a page key; two different prefixes collide with probability
//! about `n² / 2^129` for `n` registered pages.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::OnceLock;

/// 128 keyed bits of `domain`, `parent` and `data`.
fn keyed_hash(parent: u128, data: impl Hash + Copy) -> u128 {
    static KEY: OnceLock<RandomState> = OnceLock::new();
    let key = KEY.get_or_init(RandomState::new);
    let half = |domain: u8| {
        let mut h = key.build_hasher();
        domain.hash(&mut h);
        parent.hash(&mut h);
        data.hash(&mut h);
        h.finish() as u128
    };
    (half(1) << 64) | half(2)
}

/// The chained key of one full page (see the module doc).
pub(crate) fn page_key(parent: u128, tokens: &[u32]) -> u128 {
    keyed_hash(parent, tokens)
}

/// The root of a sequence's key chain: 0 without a salt (see the module
/// doc).
pub(crate) fn root_key(salt: Option<&[u8]>) -> u128 {
    // Parent u128::MAX (no page's key, but with chance 2^-128) marks a root.
    salt.map_or(0, |s| keyed_hash(u128::MAX, s))
}

/// Registered full pages of one pool.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PrefixIndex {
    by_key: HashMap<u128, i32>,
    /// `[num_pages]` the key a page is registered under.
    key_of: Vec<Option<u128>>,
}

impl PrefixIndex {
    pub fn new(num_pages: usize) -> Self {
        Self {
            by_key: HashMap::new(),
            key_of: vec![None; num_pages],
        }
    }

    /// The page registered under `key`.
    pub fn get(&self, key: u128) -> Option<i32> {
        self.by_key.get(&key).copied()
    }

    /// Whether `page` is registered (its content must not change).
    pub fn is_registered(&self, page: i32) -> bool {
        self.key_of[page as usize].is_some()
    }

    /// Registers `page` under `key` unless the key already has a page (two
    /// sequences computed the same prefix at once: the first one stays).
    pub fn insert(&mut self, key: u128, page: i32) {
        if self.key_of[page as usize].is_none() {
            if let std::collections::hash_map::Entry::Vacant(e) = self.by_key.entry(key) {
                e.insert(page);
                self.key_of[page as usize] = Some(key);
            }
        }
    }

    /// Forgets `page` (evicted, or about to be overwritten).
    pub fn remove(&mut self, page: i32) {
        if let Some(key) = self.key_of[page as usize].take() {
            self.by_key.remove(&key);
        }
    }

    /// Pages registered.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salts_root_separate_chains() {
        let page = [1u32, 2, 3, 4];
        assert_eq!(root_key(None), 0);
        let (a, b) = (root_key(Some(b"alice")), root_key(Some(b"bob")));
        assert!(a != b && a != 0 && b != 0);
        assert_eq!(root_key(Some(b"alice")), a, "a salt's root is stable");
        let keys = [page_key(0, &page), page_key(a, &page), page_key(b, &page)];
        assert!(keys[0] != keys[1] && keys[1] != keys[2] && keys[0] != keys[2]);
        assert_eq!(page_key(a, &page), keys[1]);
    }
}
